"""Bookkeeping shared by the Accelerator, its optimizers, schedulers and data loaders.

One object per Accelerator (not a process-wide singleton), so a second Accelerator in
the same process, or one made in the notebook kernel, never leaks into another. The
attribute names are accelerate's (``active_dataloader``, ``end_of_dataloader``,
``sync_gradients``, ``remainder``), so code reading ``accelerator.gradient_state`` transfers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class TracksEnd(Protocol):
    @property
    def end_of_dataloader(self) -> bool: ...

    @property
    def last_round_real_samples(self) -> int | None: ...


@dataclasses.dataclass
class GradientState:
    num_steps: int = 1  # gradient_accumulation_steps
    step: int = 0  # micro-steps entered through Accelerator.accumulate
    sync_gradients: bool = True
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    active_loaders: list[TracksEnd] = dataclasses.field(default_factory=list)

    @property
    def active_loader(self) -> TracksEnd | None:
        return self.active_loaders[-1] if self.active_loaders else None

    @property
    def active_dataloader(self) -> Any:
        """The prepared loader being iterated now (the innermost one), or None."""
        return self.active_loader

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active_loaders)

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_loader
        return loader is not None and loader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last global batch; -1 when not known (accelerate's value)."""
        loader = self.active_loader
        real = loader.last_round_real_samples if loader is not None else None
        return -1 if real is None else real

    def begin_loader(self, loader: TracksEnd) -> None:
        self.active_loaders.append(loader)

    def end_loader(self, loader: TracksEnd) -> None:
        if loader in self.active_loaders:
            self.active_loaders.remove(loader)

    @classmethod
    def _reset_state(cls) -> None:
        """Kept for code written for accelerate's singleton; each Accelerator has its own state here."""
