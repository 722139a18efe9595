"""The prepared LR scheduler: steps with the optimizer, the way accelerate's does.

As in accelerate, one ``scheduler.step()`` after a real optimizer step advances the
schedule ``num_processes`` times (once with ``split_batches=True``): a schedule written
for one process reading batches of B ends when the data does, even though each of the N
ranks now takes 1/N of the steps. While gradients accumulate, or after an fp16 step that
overflowed, the schedule does not advance.
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
        split_batches: bool = False,
        num_processes: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.num_processes = num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1  # torch's "step before optimizer.step" bookkeeping
            return  # accumulating: the optimizer did not step either
        if any(opt.step_was_skipped for opt in self.optimizers):
            return  # fp16 overflow: the weights did not change, neither does the schedule
        for _ in range(1 if self.split_batches else self.num_processes):
            total = getattr(
                self.scheduler, "total_steps", None
            )  # OneCycleLR refuses to pass its end
            if total is not None and self.scheduler._step_count > total:
                break
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
