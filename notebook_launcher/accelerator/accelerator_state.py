"""``accelerator.state`` and ``PartialState``: who this process is, with accelerate's names.

One object per Accelerator, not accelerate's process-wide singleton: a second Accelerator
(or one made in the notebook kernel) never changes what another one sees. ``PartialState``
is the same without a precision, for code that only needs ranks and collectives. Who the
process is comes from :mod:`notebook_launcher.accelerator.rank_state`; how ranks wait for
one another and split work is at the end of this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from notebook_launcher import tracking
from notebook_launcher.accelerator import operations, xla
from notebook_launcher.accelerator.rank_state import (
    DistributedType,
    RankState,
    choose_distributed_type,
    init_process_group_if_needed,
    read_rank_state,
)
from notebook_launcher.errors import AcceleratorError

F = TypeVar("F", bound=Callable[..., Any])


class PartialState:
    """Rank, world size and device of this process, as accelerate's ``PartialState`` names them.

    ``PartialState()`` reads the rank's environment (a launch of notebook_launcher, torchrun,
    or one plain process) and joins the process group when there are several ranks.
    ``cpu=True`` keeps the process on the CPU whatever the hardware.
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        rank_state = read_rank_state(cpu=cpu)
        self._created_process_group = init_process_group_if_needed(rank_state)
        self._setup(
            rank_state,
            choose_distributed_type(rank_state.device_kind, rank_state.world_size, False),
        )

    def _setup(self, rank_state: RankState, distributed_type: DistributedType) -> None:
        self.rank_state = rank_state
        self.distributed_type = distributed_type
        self.initialized = True

    @property
    def debug(self) -> bool:
        """accelerate's debug mode: collectives compare shapes across ranks first and raise
        DistributedOperationException naming each rank's shapes. On with
        ``ACCELERATE_DEBUG_MODE=1``; setting it applies to the whole process."""
        return operations.debug_mode()

    @debug.setter
    def debug(self, value: bool) -> None:
        operations.set_debug_mode(bool(value))

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the process group (or destroy ``group``); nothing happens when none exists."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    @property
    def default_device(self) -> torch.device:
        return self.device

    # accelerate's names
    @property
    def process_index(self) -> int:
        return self.rank_state.rank

    @property
    def local_process_index(self) -> int:
        return self.rank_state.local_rank

    @property
    def num_processes(self) -> int:
        return self.rank_state.world_size

    @property
    def num_processes_per_node(self) -> int:
        return self.rank_state.local_world_size

    @property
    def device(self) -> torch.device:
        return self.rank_state.device

    @property
    def backend(self) -> str:
        return self.rank_state.backend

    @property
    def is_main_process(self) -> bool:
        return self.rank_state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.rank_state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    # torch's names, used inside this core
    @property
    def rank(self) -> int:
        return self.rank_state.rank

    @property
    def local_rank(self) -> int:
        return self.rank_state.local_rank

    @property
    def world_size(self) -> int:
        return self.rank_state.world_size

    @property
    def local_world_size(self) -> int:
        return self.rank_state.local_world_size

    @property
    def device_kind(self) -> str:
        return self.rank_state.device_kind

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )

    # coordinating processes
    def wait_for_everyone(self) -> None:
        barrier(self.device_kind, self.local_rank)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return first_then_others(self.is_main_process, self.device_kind, self.local_rank)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return first_then_others(self.is_local_main_process, self.device_kind, self.local_rank)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous share of a list, tuple, tensor or dict of them."""
        yield split_between(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only (as accelerate's state does)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def on_main_process(self, function: F) -> F:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""
        return _only_when(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        return _only_when(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: F) -> F:
        return _only_when(lambda: self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: the function runs on the process with this global index only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_when(lambda: self.process_index == process_index, function)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: the function runs on the process with this index on its machine only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _only_when(lambda: self.local_process_index == local_process_index, function)


class AcceleratorState(PartialState):
    """Rank, world size, device, precision and how ranks cooperate, as accelerate names them."""

    def __init__(
        self, rank_state: RankState, mixed_precision: str, distributed_type: DistributedType
    ) -> None:
        self._setup(rank_state, distributed_type)
        self.mixed_precision = mixed_precision

    def __repr__(self) -> str:
        return super().__repr__() + f"Mixed precision type: {self.mixed_precision}\n"


def _only_when(condition: Callable[[], bool], function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if condition() else None

    return wrapper  # type: ignore[return-value]


# Coordinating ranks: what wait_for_everyone, main_process_first and
# split_between_processes do.


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
