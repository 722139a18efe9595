"""What the dashboard knows about a launch, built from its events (no display code).

The widget dashboard and the text dashboard both read this record, so they show the
same states, times, progress and metrics. Pure bookkeeping: cheap enough to run for
every event, however fast a rank logs.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Callable

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.events import (
    LaunchEvent,
    LaunchFinished,
    LaunchStarted,
    OutputLine,
    RankFinished,
    RankMetric,
    RankProgress,
    RankStarted,
)
from notebook_launcher.widgets.progress_text import parse_progress_line

RANK_STATES = ("starting", "running", "done", "failed", "stopped")
FINAL_STATES = ("done", "failed", "stopped")
OUTPUT_LINES_KEPT = 2000  # per rank; the cell's own output keeps everything
# Past this many points per curve, every other point is dropped: memory and drawing time
# stay bounded however long a rank logs, and the curve keeps its shape.
POINTS_KEPT = 4000


@dataclasses.dataclass
class Progress:
    n: float
    total: float | None
    description: str
    from_core: bool  # sent by the training core's tqdm (preferred over parsed text)

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.n / self.total))

    def label(self) -> str:
        n = _number(self.n)
        text = f"{n}/{_number(self.total)}" if self.total else f"{n} it"
        return f"{self.description}: {text}" if self.description else text


@dataclasses.dataclass
class Curve:
    steps: list[float] = dataclasses.field(default_factory=list)
    values: list[float] = dataclasses.field(default_factory=list)
    calls: int = 0  # x of the next point logged without a step

    def add(self, step: int | None, value: float) -> None:
        self.steps.append(float(self.calls if step is None else step))
        self.values.append(value)
        self.calls += 1
        if len(self.values) > POINTS_KEPT:
            del self.steps[1::2]
            del self.values[1::2]


@dataclasses.dataclass
class RankRow:
    rank: int
    state: str = "starting"
    device: str = ""
    pid: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exitcode: int | None = None
    progress: Progress | None = None
    last_line: str = ""
    error: str | None = None  # the first line of the failure, when the rank failed
    output: collections.deque[str] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES_KEPT)
    )
    output_lines: int = 0  # all lines seen, including those no longer kept
    last_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def elapsed(self, now: float) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at if self.ended_at is not None else now) - self.started_at


class LaunchRecord:
    """Apply events with :meth:`apply`; read ``rows``, ``curves`` and the launch fields."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.num_processes = 0
        self.accelerator = ""
        self.mixed_precision = ""
        self.start_method = ""
        self.fallback_reason: str | None = None
        self.started_at: float | None = None
        self.outcome: str | None = None  # "ok", "failed", "timeout", "interrupted", "stopped"
        self.elapsed: float | None = None
        self.rows: dict[int, RankRow] = {}
        self.curves: dict[tuple[str, int], Curve] = {}  # (metric, rank)
        # Bumped on every change of the kind, so that views redraw only what changed.
        self.rows_version = 0
        self.curves_version = 0
        self.output_version = 0
        self.progress_version = 0

    def now(self) -> float:
        return self._clock()

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def apply(self, event: LaunchEvent) -> None:
        if isinstance(event, OutputLine):
            self._on_output(event)
        elif isinstance(event, RankMetric):
            self._on_metric(event)
        elif isinstance(event, RankProgress):
            row = self._row(event.rank)
            row.progress = Progress(event.n, event.total, event.description, from_core=True)
            self.progress_version += 1
            self._alive(row)
        elif isinstance(event, RankStarted):
            row = self._row(event.rank)
            row.pid, row.device, row.state = event.pid, event.device, "running"
            row.started_at = self.now()
        elif isinstance(event, RankFinished):
            self._on_finished(event)
        elif isinstance(event, LaunchStarted):
            self.num_processes = event.num_processes
            self.accelerator, self.mixed_precision = event.accelerator, event.mixed_precision
            self.start_method, self.fallback_reason = event.start_method, event.fallback_reason
            self.started_at = self.now()
            if event.first_rank is not None:
                for rank in range(event.first_rank, event.first_rank + event.num_processes):
                    self._row(rank)
        elif isinstance(event, LaunchFinished):
            self.outcome, self.elapsed = event.outcome, event.elapsed
            now = self.now()
            for row in self.rows.values():
                if row.state not in FINAL_STATES:  # an interrupt ends the launch before its ranks
                    started = row.started_at is not None
                    row.state, row.ended_at = ("stopped" if started else "not started"), now
            self.rows_version += 1
        else:
            return
        self.rows_version += 1

    def _row(self, rank: int) -> RankRow:
        row = self.rows.get(rank)
        if row is None:
            row = self.rows[rank] = RankRow(rank)
        return row

    def _alive(self, row: RankRow) -> None:
        if row.state == "starting":
            row.state = "running"

    def _on_output(self, line: OutputLine) -> None:
        row = self._row(line.rank)
        self._alive(row)
        parsed = parse_progress_line(line.text)
        if parsed is not None:
            if row.progress is None or not row.progress.from_core:
                row.progress = Progress(parsed.n, parsed.total, parsed.description, from_core=False)
                self.progress_version += 1
            if line.is_progress:
                return  # a redraw: neither a line of output nor the last line
        if not line.text.strip():
            return
        if parsed is None:  # a bar's final state is shown as progress, not as the last line
            row.last_line = line.text
        row.output.append(line.text if line.stream == "stdout" else f"[stderr] {line.text}")
        row.output_lines += 1
        self.output_version += 1

    def _on_metric(self, metric: RankMetric) -> None:
        row = self._row(metric.rank)
        self._alive(row)
        for name, value in metric.values.items():
            curve = self.curves.get((name, metric.rank))
            if curve is None:
                curve = self.curves[(name, metric.rank)] = Curve()
            curve.add(metric.step, value)
        row.last_metrics.update(metric.values)
        self.curves_version += 1

    def _on_finished(self, event: RankFinished) -> None:
        row = self._row(event.rank)
        row.ended_at, row.exitcode = self.now(), event.exitcode
        row.state = rank_state(event)
        if event.failure is not None:
            row.error = failure_line(event.failure)


def rank_state(event: RankFinished) -> str:
    """done, failed or stopped: the launcher's own word."""
    return event.state if event.state in FINAL_STATES else "failed"


def failure_line(failure: RankFailure) -> str:
    """The first line of what went wrong, e.g. ``ValueError: learning rate too large``."""
    if failure.exception_type:
        text = f"{failure.exception_type}: {failure.message}" if failure.message else failure.exception_type
    else:
        text = re.sub(r"^Rank \d+ (\(pid \d+\) )?", "", failure.summary())
    lines = text.strip().splitlines()
    return lines[0] if lines else text


def _number(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
