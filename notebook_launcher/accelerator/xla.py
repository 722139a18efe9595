"""The training core on XLA devices (TPU cores), through torch_xla's own parts.

On XLA, replicas are not wrapped in DDP: ``xm.optimizer_step`` all-reduces the gradients
across replicas and steps; data reaches the device through torch_xla's parallel loader
(``MpDeviceLoader``), which overlaps the host-to-device copy with compute; collectives are
``xm.all_gather`` / ``xm.all_reduce`` and ``xm.rendezvous``; checkpoints go through
``xm.save``, which moves tensors to the CPU and writes once. The rest of the core calls in
here only when :func:`active` is true, i.e. after this process acquired its XLA device.

torch_xla is imported lazily: a core that never runs on XLA never loads it.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import cloudpickle
import torch

from notebook_launcher.errors import CollectiveError
from notebook_launcher.rank_env import inside_rank

_state = threading.local()  # per replica: v2/v3 chips run two replicas as threads of one process
# What acquired an XLA device in a process that is no launched rank (a notebook kernel):
# the launcher names it when it refuses to start ranks from that kernel.
started_outside_launch: str | None = None


def active() -> bool:
    """This replica computes on an XLA device through the training core."""
    return bool(getattr(_state, "active", False))


def acquire_device() -> torch.device:
    """This replica's XLA device; starts torch_xla's runtime if it is not running yet."""
    global started_outside_launch
    import torch_xla

    if not inside_rank() and started_outside_launch is None:
        started_outside_launch = "an Accelerator() created in this process (outside a launch)"
    make_device = getattr(torch_xla, "device", None)  # torch_xla >= 2.5; xm.xla_device before
    if make_device is None:
        import torch_xla.core.xla_model as xm

        make_device = xm.xla_device
    device = torch.device(make_device())
    _state.active = True
    return device


def rank_numbers() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) of this replica, from torch_xla."""
    import torch_xla.runtime as xr

    world_size = xr.world_size()
    local_world_size = min(world_size, xr.local_process_count() * xr.addressable_device_count())
    return xr.global_ordinal(), xr.local_ordinal(), world_size, local_world_size


def world_size() -> int:
    import torch_xla.runtime as xr

    return int(xr.world_size())


def move_model(model: torch.nn.Module, device: torch.device) -> dict[int, torch.nn.Parameter]:
    """Move ``model`` to ``device``; the new Parameter for each old one's id.

    A CPU tensor's storage cannot become an XLA one in place, so ``Module.to`` swaps in new
    Parameter objects, and an optimizer built before still holds (and steps) the CPU ones.
    """
    before = dict(model.named_parameters())
    model.to(device)
    after = dict(model.named_parameters())
    return {id(p): after[name] for name, p in before.items() if after.get(name) is not p}


def optimizer_step(optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None) -> Any:
    """All-reduce the gradients across replicas (averaged), then step.

    Gradients that :func:`reduce_gradients` averaged already (to clip them) are not
    averaged a second time.
    """
    import torch_xla.core.xla_model as xm

    reduced: set[int] = getattr(_state, "reduced", set())
    if id(optimizer) in reduced:
        reduced.discard(id(optimizer))
        result = optimizer.step(closure) if closure else optimizer.step()
    else:
        result = xm.optimizer_step(
            optimizer, optimizer_args={"closure": closure} if closure else {}
        )
    sync()
    return result


def reduce_gradients(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Average the optimizers' gradients across replicas now, once per step.

    Clipping needs the averaged gradients, as DDP gives them on other devices: clipped
    per replica, the norm and the update would depend on how the batch was split.
    """
    import torch_xla.core.xla_model as xm

    reduced: set[int] = getattr(_state, "reduced", None) or set()
    _state.reduced = reduced
    for optimizer in optimizers:
        if id(optimizer) not in reduced:
            xm.reduce_gradients(optimizer)
            reduced.add(id(optimizer))


def gradients_cleared(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's gradients were zeroed: the next ones are this replica's own again."""
    reduced: set[int] | None = getattr(_state, "reduced", None)
    if reduced:
        reduced.discard(id(optimizer))


def sync() -> None:
    """Cut the lazy graph here and run it (``torch_xla.sync``, once ``xm.mark_step``)."""
    import torch_xla

    cut = getattr(torch_xla, "sync", None)
    if cut is None:
        import torch_xla.core.xla_model as xm

        cut = xm.mark_step
    cut()


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every replica's tensor concatenated along dim 0, in ordinal order."""
    import torch_xla.core.xla_model as xm

    return xm.all_gather(tensor, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(xm.REDUCE_SUM, tensor)


def all_reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
    """Every replica's ``tensor`` combined elementwise: "sum", "mean", "max" or "min"."""
    import torch_xla.core.xla_model as xm

    kinds = {
        "sum": xm.REDUCE_SUM,
        "mean": xm.REDUCE_SUM,
        "max": xm.REDUCE_MAX,
        "min": xm.REDUCE_MIN,
    }
    result = xm.all_reduce(kinds[reduction], tensor)
    if reduction == "mean":
        result /= world_size()  # as on other devices: in place, so integer tensors refuse it
    return result


def broadcast(tensor: torch.Tensor, from_process: int) -> torch.Tensor:
    """Replica ``from_process``'s values, written into ``tensor`` on every replica."""
    import torch_xla.runtime as xr

    # A sum where only the source contributes: one all-reduce, on every torch_xla version.
    contribution = tensor if xr.global_ordinal() == from_process else torch.zeros_like(tensor)
    tensor.copy_(all_reduce_sum(contribution))
    return tensor


def broadcast_module(module: torch.nn.Module) -> None:
    """Replica 0's parameters and buffers, written into every replica's ``module``.

    DDP does this on other devices. Replicas that start from different weights (v2/v3
    replicas are threads drawing from one global RNG) would otherwise train apart:
    gradients are averaged, weights never are.
    """
    import torch_xla.core.xla_model as xm

    tensors = [
        t.data for t in [*module.parameters(), *module.buffers()] if t.dtype is not torch.bool
    ]
    if not tensors:
        return
    with torch.no_grad():
        if ordinal() != 0:
            for t in tensors:
                t.zero_()
        # One in-place sum where only replica 0 contributes.
        xm.all_reduce(xm.REDUCE_SUM, tensors)
    sync()


def ordinal() -> int:
    import torch_xla.runtime as xr

    return int(xr.global_ordinal())


def _exchange(payload: bytes) -> list[bytes]:
    """Every replica's bytes, in ordinal order (an out-of-graph exchange)."""
    import torch_xla.core.xla_model as xm

    return list(xm.rendezvous("notebook_launcher.exchange", payload))


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CpuPickler(buffer).dump(obj)
    return buffer.getvalue()


class _CpuPickler(cloudpickle.Pickler):
    """Tensors travel as CPU tensors (as ``xm.mesh_reduce`` sends them): an XLA tensor would
    be rebuilt on the sender's device name, which on v2/v3 names another replica's device."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


_PICKLED, _UNPICKLABLE = b"P", b"E"


def _exchange_objects(obj: Any, send: bool, operation: str) -> list[bytes]:
    """Every replica's pickled ``obj`` (empty where ``send`` is false), in ordinal order.

    An object that cannot be pickled still takes part in the exchange, so that every
    replica raises the same error instead of the others waiting for it forever.
    """
    failure: Exception | None = None
    try:
        payload = _PICKLED + (_dumps(obj) if send else b"")
    except Exception as error:
        failure = error
        payload = _UNPICKLABLE + f"{type(error).__name__}: {error}"[:500].encode("utf-8", "replace")
    everyone = _exchange(payload)
    failed = [
        (i, p[1:].decode("utf-8", "replace"))
        for i, p in enumerate(everyone)
        if p[:1] == _UNPICKLABLE
    ]
    if failed:
        described = "; ".join(f"replica {i}: {why}" for i, why in failed)
        raise CollectiveError(
            f"{operation} sends each replica's object pickled, but some could not be pickled "
            f"({described}). Pass plain data (numbers, strings, tensors, numpy values, "
            "dataclasses), not locks, open files, generators or objects holding them."
        ) from failure
    return [p[1:] for p in everyone]


def gather_object(obj: Any) -> list[Any]:
    """Every replica's picklable object, in ordinal order.

    Pickled here, not by ``xm.mesh_reduce``: it loads with ``torch.load(weights_only=True)``,
    which refuses numpy values, dataclasses and most other objects.
    """
    return [pickle.loads(data) for data in _exchange_objects(obj, True, "gather_object")]


def broadcast_object_list(objects: list[Any], from_process: int) -> list[Any]:
    """Replica ``from_process``'s objects (only it sends them), as a new list."""
    sent = _exchange_objects(list(objects), ordinal() == from_process, "broadcast_object_list")
    return list(pickle.loads(sent[from_process]))


def rendezvous(tag: str) -> None:
    """Wait until every replica reached ``tag`` (``xm.rendezvous``)."""
    import torch_xla.core.xla_model as xm

    xm.rendezvous(tag)


def save(obj: Any, f: str | os.PathLike[str] | io.IOBase) -> None:
    """``xm.save``: tensors to the CPU, written once per host. Every replica must call it."""
    import torch_xla.core.xla_model as xm

    xm.save(obj, f)


def device_batches(batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """Batches moved to ``device`` by torch_xla's parallel loader (copies overlap compute).

    The loader reads ``batches`` in a daemon thread of its own, where an exception only
    prints and ends the epoch early as if the data had run out: it is caught there and
    raised here, after the batches read before it. Leaving early (``break``) stops that
    thread and closes ``batches`` (a DataLoader's workers end with its iterator).
    """
    import torch_xla.distributed.parallel_loader as pl

    source = _Source(batches)
    loader = pl.ParallelLoader(source, [device])
    try:
        yield from loader.per_device_loader(device)
        if source.error is not None:
            raise source.error
    finally:
        loader.close()  # joins the loader's threads
        source.close()


class _Source:
    """The batches, read once by the parallel loader's thread, which keeps their error."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._batches = iter(batches)
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._batches
        except Exception as error:
            self.error = error

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if callable(close):
            close()
