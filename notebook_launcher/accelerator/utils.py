"""Seeding and progress bars for training code running in a rank."""

from __future__ import annotations

import functools
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from notebook_launcher import tracking

# How often a bar's count travels to the launcher's dashboard; tqdm itself redraws at 0.1 s.
_PROGRESS_REPORT_INTERVAL_S = 0.2


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators on every device.

    device_specific: add the rank to the seed, so ranks draw different numbers (e.g.
        for data augmentation) yet every run is reproducible.
    deterministic: also ask torch for deterministic algorithms (slower on GPU).
    """
    if device_specific:
        seed += _rank()
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    # manual_seed also seeds every CUDA device, lazily: it does not initialise CUDA.
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _in_launched_rank() -> bool:
    return "WORLD_SIZE" in os.environ or "NOTEBOOK_LAUNCHER_LAUNCH_ID" in os.environ


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A tqdm progress bar, shown by the main process only unless main_process_only=False.

    In a rank it is the text bar (the launcher streams it into the cell); in a plain
    notebook process it is tqdm.auto's widget.
    """
    if _in_launched_rank():
        from tqdm import tqdm as bar
    else:
        from tqdm.auto import tqdm as bar
    if main_process_only and _rank() != 0:
        kwargs["disable"] = True
    if tracking.has_progress_sink():  # in a launched rank: every rank's count, even hidden bars
        return _reporting(bar)(*args, **kwargs)
    return bar(*args, **kwargs)


@functools.cache
def _reporting(bar: type) -> type:
    """``bar`` that also reports its count, throttled, to the registered progress sinks.

    What the bar shows is unchanged; a bar hidden on the other ranks still reports, so
    the dashboard has a progress row for every rank.
    """

    class ReportingBar(bar):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._report_desc = str(kwargs.get("desc") or "")
            self._report_at = 0.0
            self._reported: int | None = None
            self._iterating = False  # tqdm's own __iter__ calls update(): count once
            super().__init__(*args, **kwargs)
            self._count = int(self.n)

        def __iter__(self) -> Any:
            self._iterating = True
            try:
                for item in super().__iter__():
                    yield item
                    self._count += 1
                    if time.monotonic() >= self._report_at:
                        self._report()
            finally:
                self._iterating = False
            self._report()

        def update(self, n: float | None = 1) -> Any:
            shown = super().update(n)
            if not self._iterating:
                self._count += int(n or 0)
            if time.monotonic() >= self._report_at:
                self._report()
            return shown

        def close(self) -> None:
            if hasattr(self, "_count"):
                self._report()
            super().close()

        def _report(self) -> None:
            self._report_at = time.monotonic() + _PROGRESS_REPORT_INTERVAL_S
            if self._count == self._reported:
                return
            self._reported = self._count
            total = self.total
            tracking.emit_progress(
                _rank(), self._count, int(total) if total is not None else None, self._report_desc
            )

    return ReportingBar
