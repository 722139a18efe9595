"""Big models on small machines: build a model empty, plan which device holds each block,
load a checkpoint straight into that plan, and run the model as one, with offloaded
weights fetched a block ahead. Names and behaviour follow accelerate's ``big_modeling``.

The names load on first use, so that the command line (which only registers its
``estimate-memory`` command here) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from notebook_launcher.big_modeling.device_map import (
        DeviceMap,
        get_balanced_memory,
        infer_auto_device_map,
    )
    from notebook_launcher.big_modeling.empty import init_empty_weights, init_on_device
    from notebook_launcher.big_modeling.estimate import MemoryEstimate, estimate_memory
    from notebook_launcher.big_modeling.loading import load_checkpoint_in_model
    from notebook_launcher.big_modeling.model_dispatch import (
        cpu_offload,
        disk_offload,
        dispatch_model,
        load_checkpoint_and_dispatch,
        remove_hooks,
    )
    from notebook_launcher.big_modeling.show import show_device_map

_WHERE = {
    "DeviceMap": "device_map",
    "get_balanced_memory": "device_map",
    "infer_auto_device_map": "device_map",
    "cpu_offload": "model_dispatch",
    "disk_offload": "model_dispatch",
    "dispatch_model": "model_dispatch",
    "load_checkpoint_and_dispatch": "model_dispatch",
    "remove_hooks": "model_dispatch",
    "init_empty_weights": "empty",
    "init_on_device": "empty",
    "MemoryEstimate": "estimate",
    "estimate_memory": "estimate",
    "load_checkpoint_in_model": "loading",
    "show_device_map": "show",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeviceMap",
    "MemoryEstimate",
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
    "remove_hooks",
    "show_device_map",
]
