"""``accelerator.state``: who this process is, with accelerate's public attribute names.

One object per Accelerator, not accelerate's process-wide singleton: a second Accelerator
(or one made in the notebook kernel) never changes what another one sees.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch

from notebook_launcher.accelerator import processes
from notebook_launcher.accelerator.state import DistributedType, RankState

F = TypeVar("F", bound=Callable[..., Any])


class AcceleratorState:
    """Rank, world size, device, precision and how ranks cooperate, as accelerate names them."""

    def __init__(
        self, rank_state: RankState, mixed_precision: str, distributed_type: DistributedType
    ) -> None:
        self.rank_state = rank_state
        self.mixed_precision = mixed_precision
        self.distributed_type = distributed_type
        self.initialized = True

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
            f"Mixed precision type: {self.mixed_precision}\n"
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


def _only_when(condition: Callable[[], bool], function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if condition() else None

    return wrapper  # type: ignore[return-value]
