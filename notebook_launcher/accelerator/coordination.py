"""The Accelerator's methods that coordinate ranks: barriers, decorators, triggers, printing.

A mixin over ``self.state`` (an :class:`AcceleratorState`), kept apart from the training
step so each module holds one concern.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from notebook_launcher.accelerator import operations
from notebook_launcher.accelerator.accelerator_state import AcceleratorState

F = TypeVar("F", bound=Callable[..., Any])


class Coordination:
    state: AcceleratorState
    _trigger: torch.Tensor | None = None

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.state.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.local_main_process_first()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous share of a list, tuple, tensor or dict of them."""
        with self.state.split_between_processes(inputs, apply_padding) as share:
            yield share

    def on_main_process(self, function: F) -> F:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: F) -> F:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: F) -> F:
        return self.state.on_last_process(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        return self.state.on_local_process(function, local_process_index=local_process_index)

    # ---- a flag any rank can raise, seen by all (e.g. stop early) ------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; the next ``check_trigger`` on every rank returns True."""
        self._trigger = torch.ones(1, device=self._collective_device())

    def check_trigger(self) -> bool:
        """True on every rank when any rank called ``set_trigger`` since the last check (a collective)."""
        flag = (
            self._trigger
            if self._trigger is not None
            else torch.zeros(1, device=self._collective_device())
        )
        total = operations.reduce(flag, "sum")
        self._trigger = None
        return bool(total.item() >= 1)

    def _collective_device(self) -> torch.device:
        # NCCL only reduces device tensors; gloo takes CPU ones.
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return self.state.device
        return torch.device("cpu") if self.state.device_kind != "tpu" else self.state.device
