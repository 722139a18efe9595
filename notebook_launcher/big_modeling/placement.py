"""Where each weight lives once a device map is applied, and putting tensors into their slots."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from notebook_launcher.big_modeling.device_map import entry_of, home_of
from notebook_launcher.big_modeling.offload import DiskStore
from notebook_launcher.big_modeling.sizes import Weight

CPU_STORE = "cpu-offload"  # kept in CPU memory, run on a GPU
DISK = "disk"
_ORDER = {"cpu": 1, DISK: 2}


def main_device(device_map: Mapping[str, str]) -> str:
    """Where offloaded blocks run: the first GPU of the map, else the CPU."""
    gpus = [d for d in device_map.values() if d.startswith("cuda:")]
    return gpus[0] if gpus else "cpu"


def exec_device(device: str, main: str) -> str:
    return device if device.startswith("cuda:") or (device == "cpu" and main == "cpu") else main


def homes(
    weights: Mapping[str, Weight],
    device_map: Mapping[str, str],
    main: str,
    offload_buffers: bool = False,
) -> dict[str, str]:
    """Each weight's home: a device it stays on, CPU_STORE, or DISK.

    A tied weight lives once, at the best place any of its names is mapped to (a GPU before
    the CPU before the disk); its other names borrow it there. Buffers stay on the device
    that runs their block (as accelerate's default), unless ``offload_buffers`` sends the
    saved ones (persistent buffers) where their block's parameters go.
    """
    result: dict[str, str] = {}
    for name, weight in weights.items():
        devices = [
            d for d in (home_of(slot.name, device_map) for slot in weight.slots) if d is not None
        ]
        if not weight.is_parameter and not (weight.persistent and offload_buffers):
            result[name] = exec_device(devices[0], main) if devices else main
            continue
        best = min(devices, key=lambda d: (_ORDER.get(d, 0), d))
        if best == DISK:
            result[name] = DISK
        elif best == "cpu" and main != "cpu":
            result[name] = CPU_STORE
        else:
            result[name] = best
    return result


def disk_blocks(
    weights: Mapping[str, Weight], device_map: Mapping[str, str], placed: Mapping[str, str]
) -> dict[str, list[str]]:
    """The weights each map entry sends to disk, so that each entry gets one file."""
    blocks: dict[str, list[str]] = {}
    for name, home in placed.items():
        if home == DISK:
            blocks.setdefault(entry_of(weights[name].slots[0].name, device_map) or "", []).append(
                name
            )
    return blocks


@dataclass
class OffloadState:
    """The weights a model keeps off its devices: in CPU memory, and in files on disk."""

    cpu: dict[str, torch.Tensor] = field(default_factory=dict)
    disk: DiskStore | None = None


def install(weight: Weight, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in every slot of ``weight``: one Parameter object, so ties hold."""
    first = weight.slots[0]
    current = (first.module._parameters if first.is_parameter else first.module._buffers)[
        first.attr
    ]
    value: torch.Tensor
    if first.is_parameter:
        requires_grad = bool(
            current is not None and current.requires_grad and tensor.is_floating_point()
        )
        value = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    else:
        value = tensor
    for slot in weight.slots:
        (slot.module._parameters if slot.is_parameter else slot.module._buffers)[slot.attr] = value  # type: ignore[assignment]
    weight.tensor = value


def current(weight: Weight) -> torch.Tensor:
    first = weight.slots[0]
    tensor = (first.module._parameters if first.is_parameter else first.module._buffers)[first.attr]
    assert tensor is not None
    return tensor


def to_meta(weight: Weight) -> None:
    """Leave only the shape behind: the data lives in an offload store."""
    tensor = current(weight)
    if tensor.device.type != "meta":
        install(weight, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
