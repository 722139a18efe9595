"""Big models on small machines: build a model empty, plan which device holds each block,
load a checkpoint straight into that plan, and run the model as one, with offloaded
weights fetched a block ahead. Names and behaviour follow accelerate's ``big_modeling``."""

from __future__ import annotations

from notebook_launcher.big_modeling.device_map import (
    DeviceMap,
    get_balanced_memory,
    infer_auto_device_map,
)
from notebook_launcher.big_modeling.dispatch import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
    remove_hooks,
)
from notebook_launcher.big_modeling.empty import init_empty_weights, init_on_device
from notebook_launcher.big_modeling.estimate import MemoryEstimate, estimate_memory
from notebook_launcher.big_modeling.loading import load_checkpoint_in_model
from notebook_launcher.big_modeling.show import show_device_map

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
