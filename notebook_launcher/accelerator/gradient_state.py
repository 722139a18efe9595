"""Bookkeeping shared by the Accelerator, its optimizers, schedulers and data loaders.

One object per Accelerator (not a process-wide singleton), so a second Accelerator in
the same process, or one made in the notebook kernel, never leaks into another.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


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
    active_loaders: list[TracksEnd] = dataclasses.field(default_factory=list)

    @property
    def active_loader(self) -> TracksEnd | None:
        return self.active_loaders[-1] if self.active_loaders else None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_loader
        return loader is not None and loader.end_of_dataloader

    def begin_loader(self, loader: TracksEnd) -> None:
        self.active_loaders.append(loader)

    def end_loader(self, loader: TracksEnd) -> None:
        if loader in self.active_loaders:
            self.active_loaders.remove(loader)
