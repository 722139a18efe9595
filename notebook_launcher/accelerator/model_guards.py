"""Checks ``prepare()`` makes of a model, for traps that otherwise fail far from their cause.

- Under fp16, a trainable parameter stored in float16: GradScaler refuses to unscale its
  gradients ("Attempting to unscale FP16 gradients") at the first optimizer step, and its
  updates underflow. Named here, with the fix.
- Under fp16, a model whose config says it was trained in bfloat16: bf16 covers fp32's range
  and fp16 does not, so activations past 65504 become inf (a warning: many such models run).
- In a rank of a multi-rank launch, a model spread over several GPUs by a device map
  (``device_map="auto"``): every rank would use every GPU, and DDP fails with "tensors on
  cuda:0 and cuda:1". Refused, naming ``device_map={"": accelerator.local_process_index}``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from notebook_launcher.errors import BigModelError, MixedPrecisionError, MixedPrecisionWarning

_NAMES_SHOWN = 3


def check_trainable_dtype(model: torch.nn.Module, mixed_precision: str) -> None:
    """MixedPrecisionError naming the trainable float16 parameters under fp16."""
    if mixed_precision != "fp16":
        return
    found = [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and parameter.dtype == torch.float16
    ]
    if not found:
        return
    names = ", ".join(repr(n) for n in found[:_NAMES_SHOWN])
    more = f" and {len(found) - _NAMES_SHOWN} more" if len(found) > _NAMES_SHOWN else ""
    plural = len(found) > 1
    raise MixedPrecisionError(
        f"prepare(): the trainable parameter{'s' if plural else ''} {names}{more} "
        f"{'are' if plural else 'is'} stored in float16 under mixed_precision='fp16'. fp16 "
        "training keeps trainable "
        "weights in float32 and computes in float16 under autocast; GradScaler cannot unscale "
        'float16 gradients ("Attempting to unscale FP16 gradients"). Load the model in float32 '
        "(torch_dtype=torch.float32), or cast the trainable ones to float32 "
        "(p.data = p.data.float() for each parameter p that requires grad)."
    )


def warn_bf16_checkpoint(model: torch.nn.Module, mixed_precision: str) -> None:
    """A warning when a model whose config says bfloat16 is trained under fp16."""
    if mixed_precision != "fp16":
        return
    config = getattr(model, "config", None)
    dtype: Any = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype not in (torch.bfloat16, "bfloat16"):
        return
    warnings.warn(
        f"{type(model).__name__}'s config says it was trained in bfloat16, and this training "
        "runs in fp16: values past fp16's 65504 become inf (a loss of nan, steps skipped by "
        "the GradScaler). On a GPU with bf16 use mixed_precision='bf16'; where there is none "
        "(T4, V100), watch the loss for nan, or train in fp32.",
        MixedPrecisionWarning,
        stacklevel=4,
    )


def check_one_device(model: torch.nn.Module, num_processes: int) -> None:
    """BigModelError when a model of a rank of a multi-rank launch spans several GPUs."""
    if num_processes < 2:
        return
    device_map = getattr(model, "hf_device_map", None)
    devices: set[str] = set()
    if isinstance(device_map, dict):
        devices = {_device_name(d) for d in device_map.values()} - {"cpu", "disk", "meta"}
    if len(devices) < 2:
        devices = {
            str(p.device) for p in model.parameters() if p.device.type not in ("cpu", "meta")
        }
    if len(devices) < 2:
        return
    raise BigModelError(
        f"prepare(): this model is spread over {', '.join(sorted(devices))} by its device map, "
        f"in a launch of {num_processes} ranks: each rank would use every GPU, and DDP fails "
        'with "tensors on cuda:0 and cuda:1". Load one copy per rank on its own GPU with '
        'device_map={"": accelerator.local_process_index} (or leave device_map out).'
    )


def _device_name(device: Any) -> str:
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)
