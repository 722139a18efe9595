"""The placement record: where each weight of a model lives once a device map is applied,
planned once and used by loading and by dispatch alike, and ``deliver()``, the one way a
tensor reaches its home (a device, CPU memory kept for offload, or a file on disk)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from notebook_launcher.big_modeling.device_map import (
    Device,
    DeviceMap,
    entry_of,
    home_of,
    normalize_device,
    resolve_device_map,
)
from notebook_launcher.big_modeling.disk_store import DiskStore, check_writable
from notebook_launcher.big_modeling.inventory import (
    Weight,
    current,
    install,
    model_weights,
    to_meta,
)
from notebook_launcher.big_modeling.sizes import target_dtype
from notebook_launcher.errors import CheckpointMismatchError


class Home(enum.Enum):
    """Where a weight waits between forwards."""

    DEVICE = "device"  # on a device, where it stays; blocks elsewhere borrow it
    CPU = "cpu memory"  # kept in CPU memory, lent to the block that runs it
    DISK = "disk"  # in a file of the offload folder, read for the block that runs it


@dataclass(frozen=True)
class Where:
    home: Home
    device: torch.device | None = None  # the device of a Home.DEVICE weight


_RANK = {"cpu": 1, "disk": 2}  # a tied weight lives at the best place any of its names is mapped to


@dataclass
class Placement:
    """Everything loading and dispatch need to agree on, planned once for a model."""

    model: str  # the model's class name, for messages
    weights: dict[str, Weight]
    device_map: DeviceMap  # checked against the model, devices normalized
    where: dict[str, Where]
    main: torch.device  # where offloaded blocks run: the first GPU of the map, else the CPU
    dtypes: dict[str, torch.dtype]  # the dtype each weight is kept in
    disk: DiskStore | None = None  # the offload folder's layout and files
    cpu: dict[str, torch.Tensor] = field(default_factory=dict)  # the CPU store

    @property
    def pin(self) -> bool:
        """Offloaded weights bound for a GPU wait in pinned memory, for copies that do not block."""
        return self.main.type == "cuda"

    def run_device(self, device: str) -> torch.device:
        """The device that runs the blocks a map entry sends to ``device``."""
        return torch.device(device) if device.startswith("cuda:") else self.main

    def offloaded(self, device: str) -> bool:
        return device == "disk" or (device == "cpu" and self.main.type != "cpu")

    def unfilled(self, supplied: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """Weights with no data anywhere: on the meta device, in no store, not supplied."""
        written = self.disk.written if self.disk is not None else set()
        return [
            n
            for n, w in self.weights.items()
            if current(w).device.type == "meta"
            and n not in self.cpu
            and n not in written
            and n not in (supplied or {})
        ]


def plan_placement(
    model: torch.nn.Module,
    device_map: Mapping[str, Device],
    *,
    main_device: Device | None = None,
    offload_buffers: bool = False,
    store_everything: bool = False,
    dtype: torch.dtype | None = None,
    keep_in_fp32_modules: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    adopt_folder: bool = False,
) -> Placement:
    """Where each weight of ``model`` lives under ``device_map``.

    A tied weight lives once, at the best place any of its names is mapped to (a GPU before
    the CPU before the disk); its other names borrow it there. Buffers stay on the device
    that runs their block (accelerate's default), unless ``offload_buffers`` sends the saved
    ones where their block's parameters go. ``store_everything`` keeps every parameter in
    the CPU store even where the blocks run on the CPU (``cpu_offload``'s contract).
    ``adopt_folder`` takes the weights an earlier load wrote into ``offload_folder`` as there.
    """
    weights = model_weights(model)
    resolved = resolve_device_map(model, device_map, weights)
    gpus = [d for d in resolved.values() if d.startswith("cuda:")]
    main = torch.device(
        normalize_device(main_device, "main_device")
        if main_device is not None
        else (gpus[0] if gpus else "cpu")
    )
    placement = Placement(type(model).__name__, weights, resolved, {}, main, {})
    fp32 = tuple(keep_in_fp32_modules or ())
    for name, weight in weights.items():
        placement.dtypes[name] = _dtype_for(weight, dtype, fp32)
        devices = [d for d in (home_of(s.name, resolved) for s in weight.slots) if d is not None]
        offloadable = weight.is_parameter or (weight.persistent and offload_buffers)
        if not offloadable:
            device = placement.run_device(devices[0]) if devices else main
            placement.where[name] = Where(Home.DEVICE, device)
            continue
        best = min(devices, key=lambda d: (_RANK.get(d, 0), d))
        if best == "disk":
            placement.where[name] = Where(Home.DISK)
        elif placement.offloaded(best) or (store_everything and best == "cpu"):
            placement.where[name] = Where(Home.CPU)
        else:
            placement.where[name] = Where(Home.DEVICE, torch.device(best))
    on_disk = [n for n, w in placement.where.items() if w.home is Home.DISK]
    if on_disk:
        entries = sorted({entry_of(weights[n].slots[0].name, resolved) or "" for n in on_disk})
        shown = ", ".join(repr(e) for e in entries[:3]) + (" ..." if len(entries) > 3 else "")
        folder, made = check_writable(offload_folder, f"device_map (blocks {shown} on 'disk')")
        placement.disk = DiskStore(folder, made_folder=made)
        if adopt_folder:
            placement.disk.adopt(
                {n: (tuple(weights[n].tensor.shape), placement.dtypes[n]) for n in on_disk}
            )
    return placement


def plan_disk_files(placement: Placement) -> None:
    """Reserve one file per map entry for the disk weights not written yet."""
    if placement.disk is None:
        return
    blocks: dict[str, list[str]] = {}
    for name, where in placement.where.items():
        if where.home is Home.DISK and name not in placement.disk.placed:
            entry = entry_of(placement.weights[name].slots[0].name, placement.device_map) or ""
            blocks.setdefault(entry, []).append(name)
    for block, names in blocks.items():
        placement.disk.plan(
            block,
            [(n, tuple(placement.weights[n].tensor.shape), placement.dtypes[n]) for n in names],
        )


def _dtype_for(weight: Weight, dtype: torch.dtype | None, fp32: tuple[str, ...]) -> torch.dtype:
    if (
        fp32
        and weight.tensor.is_floating_point()
        and any(f".{m}." in f".{weight.name}." for m in fp32)
    ):
        return torch.float32
    return target_dtype(weight.tensor.dtype, dtype)


def deliver(placement: Placement, weight: Weight, tensor: torch.Tensor) -> None:
    """Put ``tensor`` (a weight's value, from a checkpoint or from the model) in its home."""
    where = placement.where[weight.name]
    value = tensor.detach().to(dtype=placement.dtypes[weight.name])
    if where.home is Home.DISK:
        assert placement.disk is not None  # planned with every disk weight
        placement.disk.write(weight.name, value)
        to_meta(weight)
    elif where.home is Home.CPU:
        kept = value.to("cpu")
        placement.cpu[weight.name] = (
            kept.pin_memory() if placement.pin else kept.clone() if _shares_file(kept) else kept
        )
        to_meta(weight)
    else:
        assert where.device is not None
        present = current(weight)
        moved = value.to(where.device)
        if moved.data_ptr() == present.data_ptr() and moved.device == present.device:
            return  # already there, as it is
        if moved.data_ptr() == tensor.data_ptr() and _shares_file(moved):
            moved = moved.clone()  # not a view of the (mapped) checkpoint file
        install(weight, moved)


def _shares_file(tensor: torch.Tensor) -> bool:
    # A tensor torch.load mapped from a file: copy it out, so the weights do not depend on the file.
    return tensor.device.type == "cpu" and not tensor.untyped_storage().resizable()


def hand_back_cpu_store(placement: Placement) -> None:
    """Weights of the CPU store back into the model, on the CPU: what a load alone leaves."""
    for name, tensor in placement.cpu.items():
        install(placement.weights[name], tensor)
    placement.cpu.clear()


def names(found: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")


def refuse_unfilled(placement: Placement, supplied: Mapping[str, torch.Tensor]) -> None:
    empty = placement.unfilled(supplied)
    if empty:
        raise CheckpointMismatchError(
            f"{names(empty)} of {placement.model} {'is' if len(empty) == 1 else 'are'} on the meta "
            "device (no data): load the weights first (load_checkpoint_and_dispatch, or "
            "load_checkpoint_in_model with the same offload_folder), or call "
            "model.tie_weights() if they are tied to loaded ones."
        )
