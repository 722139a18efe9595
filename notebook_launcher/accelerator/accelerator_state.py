"""``accelerator.state`` and ``PartialState``: who this process is, with accelerate's names.

One object per Accelerator, not accelerate's process-wide singleton: a second Accelerator
(or one made in the notebook kernel) never changes what another one sees. ``PartialState``
is the same without a precision, for code that only needs ranks and collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from notebook_launcher.accelerator import operations, processes
from notebook_launcher.accelerator.state import (
    DistributedType,
    RankState,
    choose_distributed_type,
    init_process_group_if_needed,
    read_rank_state,
)

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
        processes.barrier(self.device_kind, self.local_rank)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return processes.first_then_others(self.is_main_process, self.device_kind, self.local_rank)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return processes.first_then_others(
            self.is_local_main_process, self.device_kind, self.local_rank
        )

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous share of a list, tuple, tensor or dict of them."""
        yield processes.split_between(inputs, self.process_index, self.num_processes, apply_padding)

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
