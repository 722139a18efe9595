"""Run a PyTorch training function on every GPU, TPU core or a few CPU processes from a notebook cell."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from notebook_launcher.api import debug_launcher, notebook_launcher
from notebook_launcher.errors import (
    AcceleratorError,
    LaunchConfigError,
    LaunchError,
    LaunchStoppedError,
    LaunchTimeoutError,
    RankFailedError,
    SessionError,
)
from notebook_launcher.server import (  # noqa: F401  (Jupyter finds its extensions here)
    _jupyter_labextension_paths,
    _jupyter_server_extension_points,
)
from notebook_launcher.session import Session
from notebook_launcher.widgets import configure, launches

try:
    __version__ = importlib.metadata.version("notebook-launcher")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

# The training core imports torch; loaded on first use so that `import notebook_launcher`
# stays fast in a kernel that only launches.
_TRAINING_CORE = {
    "Accelerator",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "PartialState",
    "ProjectConfiguration",
    "set_seed",
}

# Big-model inference (torch, and safetensors on first load); loaded on first use too.
_BIG_MODELING = {
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "estimate_memory",
    "get_balanced_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "show_device_map",
}


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext notebook_launcher``: the ``%distributed`` magics (IPython imported only now)."""
    from notebook_launcher.session.magics import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> Any:
    if name in _TRAINING_CORE:
        from notebook_launcher import accelerator

        return getattr(accelerator, name)
    if name in _BIG_MODELING:
        from notebook_launcher import big_modeling

        return getattr(big_modeling, name)
    raise AttributeError(f"module 'notebook_launcher' has no attribute {name!r}")


# Literal (not derived from _TRAINING_CORE) so that linters and type checkers can read it.
__all__ = [
    "Accelerator",
    "AcceleratorError",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "LaunchConfigError",
    "LaunchError",
    "LaunchStoppedError",
    "LaunchTimeoutError",
    "PartialState",
    "ProjectConfiguration",
    "RankFailedError",
    "Session",
    "SessionError",
    "__version__",
    "configure",
    "cpu_offload",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "estimate_memory",
    "get_balanced_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "launches",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "set_seed",
    "show_device_map",
]
