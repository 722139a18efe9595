"""Collective operations on tensors and nested containers of tensors.

Each works on one tensor or on lists, tuples, namedtuples and dicts of them, and is the
identity (or a copy) when there is one process and no process group, so training code
does not branch on the world size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from notebook_launcher.accelerator import xla
from notebook_launcher.errors import (
    CollectiveError,
    CollectiveTypeError,
    DistributedOperationException,
)

DEBUG_MODE = "ACCELERATE_DEBUG_MODE"
_debug_override: bool | None = None


def debug_mode() -> bool:
    """accelerate's debug mode: shapes are compared across ranks before every collective.

    On with ``ACCELERATE_DEBUG_MODE=1`` (read at each call) or ``accelerator.state.debug = True``.
    """
    if _debug_override is not None:
        return _debug_override
    return os.environ.get(DEBUG_MODE, "").strip().lower() in ("1", "true", "t", "yes", "y", "on")


def set_debug_mode(value: bool | None) -> None:
    """Force debug mode on or off for this process (None: follow the environment again)."""
    global _debug_override
    _debug_override = value


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
    require_tensors(data, "gather")
    if not is_distributed():
        return recursively_apply(lambda t: t.unsqueeze(0) if t.ndim == 0 else t, data)
    if not xla.active():  # torch_xla's all_gather checks shapes itself; no gloo group there
        check_same_shapes(data, "gather")
    return recursively_apply(_gather_tensor, data)


def _first_non_tensor(data: Any, path: str = "") -> tuple[str, Any] | None:
    if isinstance(data, torch.Tensor):
        return None
    if isinstance(data, (list, tuple)):
        items: Any = enumerate(data)
    elif isinstance(data, Mapping):
        items = data.items()
    else:
        return path, data
    for key, value in items:
        found = _first_non_tensor(value, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


def require_tensors(data: Any, operation: str) -> None:
    """Raise CollectiveTypeError when ``data`` holds anything but tensors.

    A Python number passed through unchanged would look combined across ranks while it
    still holds this rank's own value, so it is refused on one process as on many.
    """
    found = _first_non_tensor(data)
    if found is None:
        return
    path, value = found
    where = f" at {path}" if path else ""
    raise CollectiveTypeError(
        f"{operation} takes tensors, or lists, tuples and dicts of tensors; it got a value "
        f"of type {type(value).__name__} ({_short_repr(value)}){where}, which it cannot combine across "
        f"ranks. Make it a tensor first (torch.tensor(value, device=accelerator.device)), or "
        "use gather_object for values that are not tensors."
    )


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shapes(data: Any) -> list[tuple[str, tuple[int, ...]]]:
    found: list[tuple[str, tuple[int, ...]]] = []

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        found.append((str(tensor.dtype), tuple(tensor.shape)))
        return tensor

    recursively_apply(visit, data)
    return found


def check_same_shapes(data: Any, operation: str) -> None:
    """Raise DistributedOperationException (on every rank alike) when ranks' tensors differ."""
    mine = _shapes(data)
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, mine)
    if all(shapes == everyone[0] for shapes in everyone):
        return
    described = "; ".join(
        f"rank {r}: " + (", ".join(str(list(shape)) for _, shape in shapes) or "no tensors")
        for r, shapes in enumerate(everyone)
    )
    raise DistributedOperationException(
        f"{operation} needs tensors of the same shape and dtype on every rank, but the ranks "
        f"passed different ones ({described}). Make them equal first, e.g. "
        f"accelerator.pad_across_processes(tensor, dim=0) before accelerator.{operation}(...)."
    )


def gather_object(obj: Any) -> list[Any]:
    """Every rank's list or tuple of picklable objects, concatenated in rank order.

    As accelerate's: ``(r, "x")`` on 2 ranks gives ``[0, "x", 1, "x"]``. Anything else (a
    number, a dict, a string) raises CollectiveTypeError, also on one process: accelerate
    would iterate a dict's keys or a string's characters, or fail only on several ranks.
    """
    if not isinstance(obj, (list, tuple)):
        raise CollectiveTypeError(
            f"gather_object takes a list or tuple of picklable objects on each rank and "
            f"concatenates them in rank order; it got a value of type {type(obj).__name__} "
            f"({_short_repr(obj)}). Wrap a single object in a list: gather_object([obj]) "
            "gives one entry per rank."
        )
    return _gather_objects(list(obj))


def _gather_objects(items: list[Any]) -> list[Any]:
    if not is_distributed():
        return items
    gathered: list[Any] = [None] * world_size()
    if xla.active():
        gathered = xla.gather_object(items)
    else:
        dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


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
    require_tensors(data, "reduce")
    if debug_mode() and is_distributed() and not xla.active():
        check_same_shapes(data, "reduce")

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
    require_tensors(data, "broadcast")
    if debug_mode() and is_distributed() and not xla.active():
        check_same_shapes(data, "broadcast")

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


_MAX_DIMS = 16  # a shape is exchanged as ndim + up to this many sizes, so every rank sends alike


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Tensors padded along ``dim`` to the largest size any rank has, so they can be gathered.

    Ranks whose tensors differ in number of dimensions get DistributedOperationException
    naming every rank's shape (the backend would abort the processes instead).
    """
    require_tensors(data, "pad_across_processes")

    def pad_one(tensor: torch.Tensor) -> torch.Tensor:
        if not is_distributed():
            return tensor
        if xla.active():
            shapes = [list(tensor.shape)] * world_size()  # torch_xla checks ranks itself
        else:
            shapes = _exchange_shapes(tensor)
        if any(len(shape) != tensor.ndim for shape in shapes):
            _raise_shape_mismatch("pad_across_processes", shapes)
        if tensor.ndim == 0 or dim >= tensor.ndim or dim < -tensor.ndim:
            return tensor
        max_size = max(shape[dim] for shape in shapes)
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


def _exchange_shapes(tensor: torch.Tensor) -> list[list[int]]:
    """Every rank's shape of its tensor, in rank order (one fixed-size all-gather).

    Each rank sends its number of dimensions and up to _MAX_DIMS sizes, so every rank takes
    part alike whatever it holds; only when all ranks hold more dimensions than that do they
    exchange the full shapes in a second step.
    """
    row = torch.zeros(1, _MAX_DIMS + 1, dtype=torch.int64, device=tensor.device)
    row[0, 0] = tensor.ndim
    sent = min(tensor.ndim, _MAX_DIMS)
    if sent:
        row[0, 1 : sent + 1] = torch.tensor(tensor.shape[:sent], dtype=torch.int64)
    rows = _gather_tensor(row).tolist()
    ndims = [int(r[0]) for r in rows]
    if all(n == ndims[0] for n in ndims) and ndims[0] > _MAX_DIMS:
        everyone: list[Any] = [None] * world_size()
        dist.all_gather_object(everyone, list(tensor.shape))
        return everyone
    return [
        r[1 : min(n, _MAX_DIMS) + 1] + [-1] * max(0, n - _MAX_DIMS) for r, n in zip(rows, ndims)
    ]


def _raise_shape_mismatch(operation: str, shapes: list[list[int]]) -> None:
    described = "; ".join(f"rank {r}: {list(shape)}" for r, shape in enumerate(shapes))
    raise DistributedOperationException(
        f"{operation} needs tensors with the same number of dimensions on every rank, but the "
        f"ranks passed tensors of shapes {described}. Only the size along the padded dimension "
        "may differ; reshape them alike first."
    )


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


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's tensor, copied to every rank (the others pass None).

    Shape and dtype travel first, so only the main process needs to know them.
    """
    rank = dist.get_rank() if is_distributed() and not xla.active() else 0
    if not is_distributed():
        if tensor is None:
            raise CollectiveError(
                "copy_tensor_to_devices(None) on the main process: it has no tensor to copy; "
                "pass the tensor there (the other ranks pass None)."
            )
        return tensor
    if xla.active():
        meta = xla.gather_object(None if tensor is None else (tuple(tensor.shape), tensor.dtype))[0]
    else:
        shared: list[Any] = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
        dist.broadcast_object_list(shared, src=0)
        meta = shared[0]
    if meta is None:
        raise CollectiveError(
            "copy_tensor_to_devices got None on the main process (rank 0): it has no tensor to "
            "copy; pass the tensor on rank 0 and None on the others."
        )
    shape, dtype = meta
    if rank != 0 or tensor is None:
        device = tensor.device if tensor is not None else _collective_device()
        tensor = torch.zeros(shape, dtype=dtype, device=device)
    return broadcast(tensor.contiguous(), from_process=0)


def _collective_device() -> torch.device:
    if xla.active():
        return xla.acquire_device()
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
