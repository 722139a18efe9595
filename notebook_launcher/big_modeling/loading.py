"""``load_checkpoint_in_model``: weights from a checkpoint into a model (often built empty),
each straight to its home: a device, CPU memory kept for offload, or a file on disk.

Tensors are read one at a time (safetensors from a memory map, torch files mapped too), so
loading holds the weights kept in memory, plus the tensor being read.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch

from notebook_launcher.big_modeling.checkpoint import checkpoint_files, read_file
from notebook_launcher.big_modeling.device_map import Device, resolve_device_map
from notebook_launcher.big_modeling.offload import DiskStore, check_writable
from notebook_launcher.big_modeling.placement import (
    CPU_STORE,
    DISK,
    OffloadState,
    current,
    disk_blocks,
    homes,
    install,
    main_device,
    to_meta,
)
from notebook_launcher.big_modeling.sizes import (
    Weight,
    alias_table,
    model_weights,
    resolve_dtype,
    target_dtype,
)
from notebook_launcher.errors import CheckpointMismatchError

STATE_ATTRIBUTE = "_big_model_offload"


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Device] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    strict: bool = True,
) -> None:
    """Load ``checkpoint`` into ``model``, each weight to where ``device_map`` sends it.

    ``checkpoint`` is a ``.safetensors`` or torch ``.bin`` file, an index ``.json`` of
    sharded files, or a folder written by ``save_pretrained`` or ``Accelerator.save_model``.
    Weights mapped to ``"disk"`` are written into ``offload_folder``. Tied weights are read
    once and stay one tensor. Floating weights are cast to ``dtype`` when given, else to the
    model's own dtype.

    Raises:
        CheckpointMismatchError: the checkpoint lacks a weight the model has no value for
            (or any weight, with ``strict=True``), holds a key the model does not have
            (``strict=True``, the default here; a warning with ``strict=False``), or a
            weight of another shape.
        OffloadFolderError: weights go to disk and the folder is missing or not writable.
        DeviceMapError: the map names a module or device that does not exist, or leaves a
            weight out.
    """
    weights = model_weights(model)
    if device_map is None:
        first = next(iter(weights.values()), None)
        device = (
            "cpu"
            if first is None or first.tensor.device.type == "meta"
            else str(first.tensor.device)
        )
        device_map = {"": device}
    resolved = resolve_device_map(model, device_map, weights)
    main = main_device(resolved)
    placed = homes(weights, resolved, main, offload_buffers)
    state: OffloadState = getattr(model, STATE_ATTRIBUTE, None) or OffloadState()
    dtype_ = resolve_dtype(dtype)
    fp32 = tuple(keep_in_fp32_modules or ())
    blocks = disk_blocks(weights, resolved, placed)
    if blocks:
        folder = check_writable(
            offload_folder, f"device_map (blocks {_names(list(blocks), 3)} on 'disk')"
        )
        state.disk = state.disk or DiskStore(folder)
        for block, names in blocks.items():
            fresh = [n for n in names if n not in state.disk.placed]
            state.disk.plan(
                block,
                [
                    (n, tuple(weights[n].tensor.shape), _dtype_for(weights[n], dtype_, fp32))
                    for n in fresh
                ],
            )
    aliases = alias_table(weights)
    loaded: set[str] = set()
    unexpected: list[str] = []
    pin = main.startswith("cuda:")
    for path in checkpoint_files(checkpoint):
        for item in read_file(path):
            name = aliases.get(item.name)
            if name is None:
                unexpected.append(item.name)
                continue
            if name in loaded:
                continue  # a tied weight saved under both names
            weight = weights[name]
            if tuple(weight.tensor.shape) != item.shape:
                raise CheckpointMismatchError(
                    f"{item.name!r} has shape {list(item.shape)} in {os.fspath(path)!r}, but "
                    f"{list(weight.tensor.shape)} in the model; the checkpoint was saved from "
                    "another configuration. Build the model from the checkpoint's own config."
                )
            wanted = _dtype_for(weight, dtype_, fp32)
            tensor = item.read()
            _deliver(weight, tensor.to(wanted), placed[name], state, pin)
            del tensor
            loaded.add(name)
    _finish(model, weights, placed, loaded, unexpected, state, pin, strict, os.fspath(checkpoint))
    setattr(model, STATE_ATTRIBUTE, state)


def _dtype_for(weight: Weight, dtype: torch.dtype | None, fp32: tuple[str, ...]) -> torch.dtype:
    if (
        fp32
        and weight.tensor.is_floating_point()
        and any(f".{m}." in f".{weight.name}." for m in fp32)
    ):
        return torch.float32
    if dtype is None:
        return weight.tensor.dtype
    return target_dtype(weight.tensor.dtype, dtype)


def _deliver(
    weight: Weight, tensor: torch.Tensor, home: str, state: OffloadState, pin: bool
) -> None:
    if home == DISK:
        assert state.disk is not None
        state.disk.write(weight.name, tensor)
        to_meta(weight)
    elif home == CPU_STORE:
        kept = tensor.detach().to("cpu")
        state.cpu[weight.name] = (
            kept.pin_memory() if pin else kept.clone() if _shares_file(kept) else kept
        )
        to_meta(weight)
    else:
        moved = tensor.detach().to(home)
        if moved.data_ptr() == tensor.data_ptr() and _shares_file(moved):
            moved = moved.clone()  # not a view of the (mapped) checkpoint file
        install(weight, moved)


def _shares_file(tensor: torch.Tensor) -> bool:
    # A tensor torch.load mapped from a file: copy it out, so the weights do not depend on the file.
    return tensor.device.type == "cpu" and not tensor.untyped_storage().resizable()


def _finish(
    model: torch.nn.Module,
    weights: dict[str, Weight],
    placed: dict[str, str],
    loaded: set[str],
    unexpected: list[str],
    state: OffloadState,
    pin: bool,
    strict: bool,
    source: str,
) -> None:
    kind = type(model).__name__
    if unexpected:
        message = (
            f"the checkpoint {source!r} holds {_names(unexpected)}, which {kind} does not have; "
            "it was saved from another model or configuration"
        )
        if strict:
            raise CheckpointMismatchError(message + " (pass strict=False to skip such keys).")
        warnings.warn(message + "; skipped.", stacklevel=3)
    absent = [n for n, w in weights.items() if n not in loaded and w.persistent]
    written = state.disk.written if state.disk is not None else set()
    on_meta = [
        n
        for n, w in weights.items()
        if n not in loaded
        and current(w).device.type == "meta"
        and n not in state.cpu
        and n not in written
    ]
    if on_meta or (strict and absent):
        missing = on_meta or absent
        raise CheckpointMismatchError(
            f"the checkpoint {source!r} has no value for {_names(missing)} of {kind}"
            + (", which would be left on the meta device (no data)" if on_meta else "")
            + "; load the checkpoint saved from this model, or build the model with real "
            "weights and pass strict=False to keep those."
        )
    for name, weight in weights.items():
        if name in loaded:
            continue
        tensor = current(weight)
        if tensor.device.type == "meta":
            continue  # offloaded before (an earlier load), or a non-persistent buffer checked above
        _deliver(weight, tensor, placed[name], state, pin)
    if state.disk is not None:
        state.disk.finish_writing()


def attach_state(model: torch.nn.Module) -> OffloadState:
    """The model's offload stores, created empty on first use."""
    state: OffloadState | None = getattr(model, STATE_ATTRIBUTE, None)
    if state is None:
        state = OffloadState()
        setattr(model, STATE_ATTRIBUTE, state)
    return state
