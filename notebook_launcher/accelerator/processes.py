"""Helpers that coordinate ranks: barriers, ordering, and splitting work between them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from notebook_launcher import tracking
from notebook_launcher.accelerator import xla
from notebook_launcher.errors import AcceleratorError


def barrier(device_kind: str, local_rank: int) -> None:
    tracking.flush_metrics()  # what was logged is out before this rank waits, maybe to be stopped
    if device_kind == "tpu" and xla.active():
        xla.rendezvous("notebook_launcher.wait_for_everyone")
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if device_kind == "cuda":
        # Naming the device spares NCCL a guess (and its warning) about which GPU to use.
        dist.barrier(device_ids=[local_rank])
    else:
        dist.barrier()


@contextlib.contextmanager
def first_then_others(is_first: bool, device_kind: str, local_rank: int) -> Iterator[None]:
    """The first process runs the block, then the others (e.g. download once, then read)."""
    if not is_first:
        barrier(device_kind, local_rank)
    yield
    if is_first:
        barrier(device_kind, local_rank)


def _length(value: Any) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


def _slice(value: Any, start: int, end: int, pad_to: int | None) -> Any:
    part = value[start:end]
    if pad_to is None or _length(part) >= pad_to:
        return part
    missing = pad_to - _length(part)
    # Repeat the last input, so every rank runs the same number of items.
    if isinstance(value, torch.Tensor):
        filler = value[-1:].expand(missing, *value.shape[1:])
        return torch.cat([part, filler])
    return (
        type(part)(list(part) + [value[-1]] * missing) if isinstance(part, (list, tuple)) else part
    )


def split_between(inputs: Any, rank: int, world_size: int, apply_padding: bool) -> Any:
    """This rank's contiguous share of ``inputs`` (list, tuple, tensor, or dict of those)."""
    if world_size == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise AcceleratorError(
                f"split_between_processes got a dict whose values have different lengths "
                f"{lengths}; give every value the same length."
            )
        return type(inputs)(  # type: ignore[call-arg]
            {k: split_between(v, rank, world_size, apply_padding) for k, v in inputs.items()}
        )
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise AcceleratorError(
            f"split_between_processes cannot split a {type(inputs).__name__}; pass a list, "
            "tuple, tensor, or a dict of them."
        )
    total = _length(inputs)
    size, extra = divmod(total, world_size)
    start = rank * size + min(rank, extra)
    end = start + size + (1 if rank < extra else 0)
    pad_to = size + (1 if extra else 0) if apply_padding and total else None
    return _slice(inputs, start, end, pad_to)
