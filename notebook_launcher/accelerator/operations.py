"""Collective operations on tensors and nested containers of tensors.

Each works on one tensor or on lists, tuples, namedtuples and dicts of them, and is the
identity (or a copy) when there is one process and no process group, so training code
does not branch on the world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from notebook_launcher.accelerator import xla

# torch 2.13 renamed all_gather_into_tensor; the old name warns there and is the only one before.
_all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)


def is_distributed() -> bool:
    if xla.active():  # XLA replicas cooperate through torch_xla, with or without a group
        return xla.world_size() > 1
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    if xla.active():
        return xla.world_size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def recursively_apply(function: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``function`` applied to every tensor in ``data``, keeping the container types."""
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(recursively_apply(function, d) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(function, d) for d in data)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(function, v) for k, v in data.items()})  # type: ignore[call-arg]
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    return recursively_apply(move, data)


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.unsqueeze(0)  # a scalar per rank becomes one row per rank
    tensor = tensor.contiguous()
    if xla.active():
        return xla.all_gather(tensor)
    # Gloo has no all-gather for bool.
    as_bool = tensor.dtype == torch.bool
    source = tensor.to(torch.uint8) if as_bool else tensor
    output = source.new_empty((world_size() * source.shape[0], *source.shape[1:]))
    _all_gather_single(output, source)
    return output.bool() if as_bool else output


def gather(data: Any) -> Any:
    """Every rank's tensors concatenated along the first dimension, in rank order.

    All ranks must pass tensors of the same shape; ``pad_across_processes`` first when
    they differ.
    """
    if not is_distributed():
        return recursively_apply(lambda t: t.unsqueeze(0) if t.ndim == 0 else t, data)
    return recursively_apply(_gather_tensor, data)


def gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable object; lists are concatenated in rank order."""
    if not is_distributed():
        return list(obj) if isinstance(obj, list) else [obj]
    gathered: list[Any] = [None] * world_size()
    if xla.active():
        gathered = xla.gather_object(obj)
    else:
        dist.all_gather_object(gathered, obj)
    if isinstance(obj, list):
        return [item for part in gathered for item in part]
    return gathered


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Every rank's tensors summed (or averaged with reduction="mean") into each rank."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'sum' or 'mean'.")

    def reduce_one(tensor: torch.Tensor) -> torch.Tensor:
        result = tensor.clone()
        if is_distributed() and xla.active():
            result = xla.all_reduce_sum(result)
        elif is_distributed():
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                result /= world_size()
        if scale != 1.0:
            result *= scale
        return result

    return recursively_apply(reduce_one, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """The tensors of rank ``from_process``, copied in place into every rank's tensors."""

    def broadcast_one(tensor: torch.Tensor) -> torch.Tensor:
        if is_distributed() and xla.active():
            xla.broadcast(tensor, from_process)
        elif is_distributed():
            dist.broadcast(tensor, src=from_process)
        return tensor

    return recursively_apply(broadcast_one, data)


def broadcast_object_list(objects: list[Any], from_process: int = 0) -> list[Any]:
    """Rank ``from_process``'s picklable objects, written into ``objects`` on every rank."""
    if is_distributed() and xla.active():
        objects[:] = xla.gather_object(list(objects))[from_process * len(objects):][: len(objects)]
    elif is_distributed():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Tensors padded along ``dim`` to the largest size any rank has, so they can be gathered."""

    def pad_one(tensor: torch.Tensor) -> torch.Tensor:
        if not is_distributed() or tensor.ndim == 0 or dim >= tensor.ndim or dim < -tensor.ndim:
            return tensor
        size = torch.tensor(tensor.shape, device=tensor.device)
        max_size = int(_gather_tensor(size[None]).max(dim=0).values[dim])
        if max_size == tensor.shape[dim]:
            return tensor
        new_shape = list(tensor.shape)
        new_shape[dim] = max_size
        padded = tensor.new_full(new_shape, pad_index)
        length = tensor.shape[dim]
        start = max_size - length if pad_first else 0
        padded.narrow(dim, start, length).copy_(tensor)
        return padded

    return recursively_apply(pad_one, data)
