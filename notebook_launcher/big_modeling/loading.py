"""``load_checkpoint_in_model``: weights from a checkpoint into a model (often built empty),
each straight to its home through ``deliver()``.

Tensors are read one at a time (safetensors from a memory map, torch files mapped too), so
loading holds the weights kept in memory, plus the tensor being read. A load that fails
closes and removes the offload files it wrote.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch

from notebook_launcher.big_modeling.checkpoint import checkpoint_files, read_file
from notebook_launcher.big_modeling.device_map import Device
from notebook_launcher.big_modeling.inventory import alias_table, current
from notebook_launcher.big_modeling.placement import (
    Placement,
    deliver,
    hand_back_cpu_store,
    names,
    plan_disk_files,
    plan_placement,
)
from notebook_launcher.big_modeling.sizes import resolve_dtype
from notebook_launcher.errors import CheckpointMismatchError


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
    Weights mapped to ``"disk"`` are written into ``offload_folder`` (pass the same folder
    to :func:`dispatch_model`). Tied weights are read once and stay one tensor. Floating
    weights are cast to ``dtype`` when given, else kept in the model's own dtype; those of
    modules named in ``keep_in_fp32_modules`` stay in float32.

    Raises:
        CheckpointMismatchError: the checkpoint lacks a weight the model has no value for
            (or any weight, with ``strict=True``), holds a key the model does not have
            (``strict=True``, the default here; a warning with ``strict=False``), or a
            weight of another shape.
        OffloadFolderError: weights go to disk and the folder is missing or not writable.
        DeviceMapError: the map names a module or device that does not exist, or leaves a
            weight out.
    """
    if device_map is None:
        first = next(iter(model.parameters()), None)
        device = "cpu" if first is None or first.device.type == "meta" else str(first.device)
        device_map = {"": device}
    placement = plan_and_load(
        model,
        checkpoint,
        device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_buffers=offload_buffers,
        keep_in_fp32_modules=keep_in_fp32_modules,
        strict=strict,
    )
    # Alone, a load leaves the weights kept for offload on the CPU, in the model (as
    # accelerate's does); dispatch_model takes them from there without a copy.
    hand_back_cpu_store(placement)
    if placement.disk is not None:
        placement.disk.close()


def plan_and_load(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Device],
    *,
    offload_folder: str | os.PathLike[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
    keep_in_fp32_modules: list[str] | None,
    strict: bool,
) -> Placement:
    """The placement of ``model`` under ``device_map``, with ``checkpoint`` read into it:
    the first half of a load, alone or followed by a dispatch."""
    placement = plan_placement(
        model,
        device_map,
        offload_buffers=offload_buffers,
        dtype=resolve_dtype(dtype),
        keep_in_fp32_modules=keep_in_fp32_modules,
        offload_folder=offload_folder,
    )
    load_into(placement, checkpoint, strict)
    return placement


def load_into(
    placement: Placement, checkpoint: str | os.PathLike[str], strict: bool = True
) -> None:
    """Read ``checkpoint`` into the homes ``placement`` planned. On failure, the offload
    files written are closed and removed before the error goes on."""
    try:
        plan_disk_files(placement)
        _read(placement, checkpoint, strict)
    except BaseException:
        if placement.disk is not None:
            placement.disk.abort()
        raise


def _read(placement: Placement, checkpoint: str | os.PathLike[str], strict: bool) -> None:
    weights = placement.weights
    aliases = alias_table(weights)
    loaded: set[str] = set()
    unexpected: list[str] = []
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
            deliver(placement, weight, item.read())
            loaded.add(name)
    source = os.fspath(checkpoint)
    kind = placement.model
    if unexpected:
        message = (
            f"the checkpoint {source!r} holds {names(unexpected)}, which {kind} does not have; "
            "it was saved from another model or configuration"
        )
        if strict:
            raise CheckpointMismatchError(message + " (pass strict=False to skip such keys).")
        warnings.warn(message + "; skipped.", stacklevel=4)
    absent = [n for n, w in weights.items() if n not in loaded and w.persistent]
    on_meta = [n for n in placement.unfilled() if n not in loaded]
    if on_meta or (strict and absent):
        raise CheckpointMismatchError(
            f"the checkpoint {source!r} has no value for {names(on_meta or absent)} of {kind}"
            + (", which would be left on the meta device (no data)" if on_meta else "")
            + "; load the checkpoint saved from this model, or build the model with real "
            "weights and pass strict=False to keep those."
        )
    for name, weight in weights.items():
        tensor = current(weight)
        if name not in loaded and tensor.device.type != "meta":
            deliver(placement, weight, tensor)  # kept from the model (strict=False, buffers)
    if placement.disk is not None:
        placement.disk.finish_writing()
