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
from notebook_launcher.errors import CollectiveError

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

    All ranks must pass tensors of the same shapes (checked first: a mismatch raises
    CollectiveError on every rank instead of aborting the ranks inside the
    backend); ``pad_across_processes`` first when they differ.
    """
    if not is_distributed():
        return recursively_apply(lambda t: t.unsqueeze(0) if t.ndim == 0 else t, data)
    if not xla.active():  # torch_xla's all_gather checks shapes itself; no gloo group there
        check_same_shapes(data, "gather")
    return recursively_apply(_gather_tensor, data)


def _shapes(data: Any) -> list[tuple[str, tuple[int, ...]]]:
    found: list[tuple[str, tuple[int, ...]]] = []

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        found.append((str(tensor.dtype), tuple(tensor.shape)))
        return tensor

    recursively_apply(visit, data)
    return found


def check_same_shapes(data: Any, operation: str) -> None:
    """Raise CollectiveError (on every rank alike) when ranks' tensors differ in shape."""
    mine = _shapes(data)
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, mine)
    if all(shapes == everyone[0] for shapes in everyone):
        return
    described = "; ".join(
        f"rank {r}: " + (", ".join(str(list(shape)) for _, shape in shapes) or "no tensors")
        for r, shapes in enumerate(everyone)
    )
    raise CollectiveError(
        f"{operation} needs tensors of the same shape and dtype on every rank, but the ranks "
        f"passed different ones ({described}). Make them equal first, e.g. "
        f"accelerator.pad_across_processes(tensor, dim=0) before accelerator.{operation}(...)."
    )


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


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Every rank's tensors combined elementwise into each rank: "sum", "mean", "max" or "min"."""
    if reduction not in _REDUCE_OPS:
        raise CollectiveError(
            f"reduce(..., reduction={reduction!r}) is not a reduction this core knows; "
            "use 'sum', 'mean', 'max' or 'min'."
        )

    def reduce_one(tensor: torch.Tensor) -> torch.Tensor:
        result = tensor.clone()
        if is_distributed() and xla.active():
            result = xla.all_reduce(result, reduction)
        elif is_distributed():
            dist.all_reduce(result, op=_REDUCE_OPS[reduction])
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
        objects[:] = xla.broadcast_object_list(objects, from_process)
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


# ---- batches as collections of samples (for gather_for_metrics and dispatching) -----------
def _is_samples_list(data: Any) -> bool:
    """A list/tuple holding one plain value per sample (strings, numbers), as collate makes."""
    return isinstance(data, (list, tuple)) and not any(
        isinstance(d, (torch.Tensor, Mapping, list, tuple)) for d in data
    )


def concatenate(parts: list[Any]) -> Any:
    """Batches (same structure) joined sample-wise: tensors along dim 0, sample lists end to end."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p.unsqueeze(0) if p.ndim == 0 else p for p in parts])
    if _is_samples_list(first):
        return type(first)(item for p in parts for item in p)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concatenate([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([p[k] for p in parts]) for k in first})  # type: ignore[call-arg]
    return list(parts)


def slice_samples(data: Any, start: int, end: int) -> Any:
    """Samples ``start:end`` of a batch, whatever its structure."""
    if isinstance(data, torch.Tensor) or _is_samples_list(data):
        return data[start:end]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(slice_samples(d, start, end) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(slice_samples(d, start, end) for d in data)
    if isinstance(data, Mapping):
        return type(data)({k: slice_samples(v, start, end) for k, v in data.items()})  # type: ignore[call-arg]
    return data


def sample_count(data: Any) -> int:
    """How many samples a batch holds (its first tensor's or sample list's length)."""
    if isinstance(data, torch.Tensor):
        return int(data.shape[0]) if data.ndim else 1
    if _is_samples_list(data):
        return len(data)
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for d in data:
            n = sample_count(d)
            if n >= 0:
                return n
    return -1
