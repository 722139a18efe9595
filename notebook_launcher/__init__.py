"""Run a PyTorch training function on every GPU, TPU core or a few CPU processes from a notebook cell."""

from __future__ import annotations

import importlib.metadata

from notebook_launcher.errors import (
    LaunchConfigError,
    LaunchError,
    LaunchStoppedError,
    LaunchTimeoutError,
    RankFailedError,
)
from notebook_launcher.launcher.api import debug_launcher, notebook_launcher

try:
    __version__ = importlib.metadata.version("notebook-launcher")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "LaunchConfigError",
    "LaunchError",
    "LaunchStoppedError",
    "LaunchTimeoutError",
    "RankFailedError",
    "__version__",
    "debug_launcher",
    "notebook_launcher",
]
