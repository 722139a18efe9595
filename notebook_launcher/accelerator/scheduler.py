"""The prepared LR scheduler: steps once per real optimizer step.

Unlike accelerate (which steps a scheduler num_processes times per call unless
split_batches), this steps once per optimizer step, as the same loop does in one
process with the global batch: N ranks with batch B and one process with batch N*B
then follow the same learning-rate curve, which the parity guarantee needs.
"""

from __future__ import annotations

from typing import Any

from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.optimizer import AcceleratedOptimizer


class AcceleratedScheduler:
    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        *,
        gradient_state: GradientState,
        step_with_optimizer: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.step_with_optimizer:
            if not self.gradient_state.sync_gradients:
                return  # accumulating: the optimizer did not step either
            if any(opt.step_was_skipped for opt in self.optimizers):
                return  # fp16 overflow: the weights did not change, neither does the schedule
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Anything else (last_epoch, base_lrs, get_lr, ...) is the wrapped scheduler's.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
