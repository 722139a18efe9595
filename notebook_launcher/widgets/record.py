"""What the dashboard knows about a launch, built from its events (no display code).

The widget dashboard and the text dashboard both read this record, so they show the
same states, times, progress and metrics. Pure bookkeeping: cheap enough to run for
every event, however fast a rank logs.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import re
import time
from collections.abc import MutableSequence, Sequence
from typing import Any, Callable

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.diagnosis import Diagnosis, diagnose
from notebook_launcher.launcher.events import (
    LaunchEvent,
    LaunchFinished,
    LaunchStarted,
    OutputLine,
    RankFinished,
    RankMemory,
    RankMetrics,
    RankProgress,
    RankStarted,
    RankSteps,
    RankWhere,
)
from notebook_launcher.launcher.metric_batch import MetricBatch
from notebook_launcher.rank_memory import MachineMemory, machine_memory
from notebook_launcher.shown_text import cut, cut_lines
from notebook_launcher.widgets.progress_text import parse_progress_line

FINAL_STATES = ("done", "failed", "stopped", "not started")
OUTPUT_LINES_KEPT = 2000  # per rank; the cell's own output keeps everything
# Past this many points per curve, every other point is dropped (and from then on only
# every second, fourth, ... call is kept): memory, drawing time and the cost of a log call
# stay bounded however long a rank logs, and the curve keeps its shape.
POINTS_KEPT = 4000
NONFINITE_KEPT = 200  # NaN/inf points kept per curve besides the thinned ones, to mark them
# Metric names kept per launch, the first to reach the kernel: a name made per sample or
# per step (f"loss_{i}") would otherwise keep a curve each, in a record the kernel holds
# among its last launches. Values logged under later names are counted, not kept.
METRICS_KEPT = 1000
MACHINE_READ_S = 1.0
_NAMES_NOT_KEPT_SHOWN = 3
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_text(text: str) -> str:
    """What a rank wrote, fit to show: ANSI colour codes and control characters removed,
    undecodable bytes (surrogates) replaced, so no frontend shows ``[31m`` and no message
    to the frontend fails to encode."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    text = _CONTROL.sub("", text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


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


def _as_floats(ints: array.array) -> array.array:
    """``ints`` (an array of "q") as an array of doubles, as ``float`` makes them."""
    import numpy  # a dependency; torch has imported it already in a kernel that launched

    floats = array.array("d")
    floats.frombytes(numpy.frombuffer(ints, dtype=numpy.int64).astype(numpy.float64).tobytes())
    return floats


def _points_array() -> MutableSequence[float]:
    return array.array("d")  # 8 bytes a point, and nothing for the garbage collector to visit


@dataclasses.dataclass
class Curve:
    steps: MutableSequence[float] = dataclasses.field(default_factory=_points_array)
    values: MutableSequence[float] = dataclasses.field(default_factory=_points_array)
    calls: int = 0  # points logged (x of the next point logged without a step)
    stride: int = 1  # every stride-th call is kept
    nonfinite: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    nonfinite_calls: int = 0  # NaN/inf values logged, including those not kept
    last: tuple[float, float] | None = None  # the latest point, when thinning passed it by

    def points(self) -> tuple[list[float], list[float]]:
        """Steps and values kept, ending at the latest point logged."""
        if self.last is None:
            return list(self.steps), list(self.values)
        return [*self.steps, self.last[0]], [*self.values, self.last[1]]

    def latest(self) -> tuple[float, float] | None:
        """The latest point logged (kept among the points or not); None before any."""
        if self.last is not None:
            return self.last
        return (self.steps[-1], self.values[-1]) if self.values else None

    def add(self, step: float | None, value: float) -> None:
        calls = self.calls
        self.calls = calls + 1
        if value - value != 0.0:  # NaN or inf, kept apart so that thinning never hides one
            self.nonfinite_calls += 1
            if len(self.nonfinite) < NONFINITE_KEPT:
                self.nonfinite.append((float(calls if step is None else step), value))
        elif calls % self.stride:
            self.last = (float(calls if step is None else step), value)
            return
        self.last = None
        self.steps.append(float(calls if step is None else step))
        self.values.append(value)
        if len(self.values) > POINTS_KEPT:
            self._thin()

    def extend(self, values: Sequence[float], steps: Sequence[float | None]) -> None:
        """Finite numbers logged one after another, with their steps (None: logged without
        one), kept exactly as ``add`` called for each would keep them, by slices instead
        of a Python call per value: only the steps of the points kept are read."""
        calls, count = self.calls, len(values)
        self.calls = calls + count
        index = -calls % self.stride  # the first of these calls that falls on the stride
        final_kept = False
        while index < count:
            stride = self.stride
            # At most as many points as fit before the next thinning, which doubles the stride.
            stop = min(count, index + (POINTS_KEPT + 1 - len(self.values)) * stride)
            if isinstance(steps, array.array) and steps.typecode == "q":  # ints: converted in C
                self.steps.extend(_as_floats(steps[index:stop:stride]))
            else:
                self.steps.extend([
                    float(calls + at if step is None else step)
                    for at, step in zip(range(index, stop, stride), steps[index:stop:stride])
                ])  # fmt: skip
            self.values.extend(values[index:stop:stride])
            final_kept = stop == count and (count - 1 - index) % stride == 0
            if len(self.values) <= POINTS_KEPT:
                break
            self._thin()  # keeps the point just appended: it has an even index
            index = stop + -(calls + stop) % self.stride
        if not final_kept:
            (step,) = steps[count - 1 : count]
            self.last = (float(calls + count - 1 if step is None else step), float(values[-1]))
        else:
            self.last = None

    def _thin(self) -> None:
        del self.steps[1::2]
        del self.values[1::2]
        self.stride *= 2


@dataclasses.dataclass
class RankRow:
    rank: int
    state: str = "starting"
    device: str = ""
    pid: int | None = None
    # The launch's start: a row's time counts from there, so that it moves on at once,
    # while the kernel still prepares the launch and the rank's process is being started.
    started_at: float | None = None
    ended_at: float | None = None
    exitcode: int | None = None
    progress: Progress | None = None
    last_line: str = ""
    error: str | None = None  # the first line of the failure, when the rank failed
    # Where it was when the launch ended it from outside (timeout=, a stop): "was in cell 5, ..."
    where: str | None = None
    output: collections.deque[str] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES_KEPT)
    )
    output_lines: int = 0  # all lines seen, including those no longer kept
    last_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    memory: RankMemory | None = None  # the latest reading: peak RSS, or peak CUDA allocations
    # Where its training steps go, from the Accelerator (medians per step); None before it
    # took a step through one, or in a launch that does not use it.
    steps: dict[str, Any] | None = None

    @property
    def peak_memory(self) -> int | None:
        return None if self.memory is None else self.memory.peak_bytes

    def elapsed(self, now: float) -> float | None:
        if self.started_at is None or self.state == "not started":
            return None
        return (self.ended_at if self.ended_at is not None else now) - self.started_at


class DashboardRecord:
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
        self._names: dict[str, str] = {}  # metric name as logged -> as shown
        self._by_raw: dict[tuple[str, int], Curve] = {}  # (metric as logged, rank)
        self.values_not_kept = 0  # logged under names past the first METRICS_KEPT
        self.names_not_kept: list[str] = []  # the first few of those names, as shown
        self.failures: dict[int, RankFailure] = {}
        self.machine_memory: MachineMemory | None = None  # read as the ranks report theirs
        self._machine_read_at: float | None = None
        self._diagnosis: tuple[int, Diagnosis | None] = (-1, None)  # (steps_version, found)
        self.steps_version = 0
        self.notice: str | None = None  # the latest line of an event without a row of its own
        self.wall_started_at = time.time()
        self.ended_at: float | None = None
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
        elif isinstance(event, RankMetrics):
            self._on_metrics(event.rank, event.batch)
        elif isinstance(event, RankProgress):
            row = self._row(event.rank)
            row.progress = Progress(
                event.n, event.total, clean_text(event.description), from_core=True
            )
            self.progress_version += 1
            self._alive(row)
        elif isinstance(event, RankStarted):
            row = self._row(event.rank)
            row.pid, row.device, row.state = event.pid, event.device, "running"
            row.ended_at = None  # a rank started again (max_restarts) runs on
            if row.started_at is None:  # a record that was not told of the launch's start
                row.started_at = self.now()
        elif isinstance(event, RankFinished):
            self._on_finished(event)
        elif isinstance(event, RankMemory):
            # The rank's own peak so far (a restarted rank starts it over).
            self._row(event.rank).memory = event
            self._read_machine_memory()
        elif isinstance(event, RankSteps):
            self._row(event.rank).steps = dict(event.summary)
            self.steps_version += 1
        elif isinstance(event, RankWhere):
            self._row(event.rank).where = clean_text(event.where)
        elif isinstance(event, LaunchStarted):
            self.num_processes = event.num_processes
            self.accelerator, self.mixed_precision = event.accelerator, event.mixed_precision
            self.start_method, self.fallback_reason = event.start_method, event.fallback_reason
            self.started_at = self.now()
            if event.first_rank is not None:
                for rank in range(event.first_rank, event.first_rank + event.num_processes):
                    self._row(rank)
        elif isinstance(event, LaunchFinished):
            self.outcome, self.elapsed, self.ended_at = event.outcome, event.elapsed, time.time()
            now = self.now()
            for row in self.rows.values():
                if row.state not in FINAL_STATES:  # an interrupt ends the launch before its ranks
                    started = row.state != "starting"
                    row.state, row.ended_at = ("stopped" if started else "not started"), now
            self.rows_version += 1
        else:
            # Events this record does not know (a restart, waiting for machines) are shown
            # by the line they carry.
            line = getattr(event, "line", None)
            if not isinstance(line, str):
                return
            self.notice = clean_text(line)
        self.rows_version += 1

    def diagnosis(self) -> Diagnosis | None:
        """What limits the launch, from its ranks' steps; None where no rank took a step."""
        version, found = self._diagnosis
        if version != self.steps_version:
            steps = {rank: row.steps for rank, row in self.rows.items()}
            found = diagnose(steps, self.num_processes or len(steps), self.accelerator)
            self._diagnosis = (self.steps_version, found)
        return found

    def _read_machine_memory(self) -> None:
        # The ranks report about once a second each: the machine is read at most as often.
        now = self.now()
        if self._machine_read_at is None or now - self._machine_read_at >= MACHINE_READ_S:
            self._machine_read_at = now
            self.machine_memory = machine_memory()

    def _row(self, rank: int) -> RankRow:
        row = self.rows.get(rank)
        if row is None:
            row = self.rows[rank] = RankRow(rank, started_at=self.started_at)
        return row

    def _alive(self, row: RankRow) -> None:
        if row.state == "starting":
            row.state = "running"

    def _on_output(self, event: OutputLine) -> None:
        row = self._row(event.rank)
        self._alive(row)
        # Cut first: cleaning and parsing cost by the character.
        line = dataclasses.replace(event, text=clean_text(cut(event.text)))
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

    def forget_output(self) -> None:
        """Let the ranks' output lines go (a finished launch's record shows none of them)."""
        for row in self.rows.values():
            row.output.clear()

    def _on_metrics(self, rank: int, batch: MetricBatch) -> None:
        """Log calls of one rank, in order: the same result whether they come in one batch
        or in many.

        Each metric's column is kept by slices of its array, so a flood of log calls costs
        a few nanoseconds per call. A column that may hold NaN or inf is kept value by value.
        """
        if not len(batch):
            return
        row = self.rows.get(rank) or self._row(rank)
        if row.state == "starting":
            row.state = "running"
        curves = [
            self._by_raw.get((name, rank)) or self._new_curve(name, rank) for name in batch.columns
        ]
        kept = [curve for curve in curves if curve is not None]
        if len(set(map(id, kept))) < len(kept):
            # Names shown alike share a curve, whose points must keep the calls' order.
            self._metrics_one_by_one(row, batch)
        else:
            last, shown = row.last_metrics, self._names
            for (name, column), curve in zip(batch.columns.items(), curves):
                if curve is None:
                    self.values_not_kept += len(column.values)
                    continue
                steps = batch.steps_of(column)
                if column.finite:
                    curve.extend(column.values, steps)
                else:
                    for step, value in zip(steps, column.values):
                        curve.add(step, value)
                last[shown[name]] = column.values[-1]
        self.curves_version += 1

    def _metrics_one_by_one(self, row: RankRow, batch: MetricBatch) -> None:
        by_raw, names, last = self._by_raw, self._names, row.last_metrics
        for step, logged in zip(batch.steps, batch.calls()):
            for name, value in logged.items():
                curve = by_raw.get((name, row.rank))
                if curve is None:
                    self.values_not_kept += 1
                    continue
                curve.add(step, value)
                last[names[name]] = value

    def _new_curve(self, name: str, rank: int) -> Curve | None:
        """The curve for a name first logged by ``rank``; None past ``METRICS_KEPT`` names."""
        curve = self._curve(name, rank)
        if curve is not None:
            self._by_raw[(name, rank)] = curve
        return curve

    def _curve(self, name: str, rank: int) -> Curve | None:
        shown = self._names.get(name)
        if shown is None:
            if len(self._names) >= METRICS_KEPT:
                missed = _metric_name(name)
                if (
                    len(self.names_not_kept) < _NAMES_NOT_KEPT_SHOWN
                    and missed not in self.names_not_kept
                ):
                    self.names_not_kept.append(missed)
                return None
            shown = self._names[name] = _metric_name(name)
        curve = self.curves.get((shown, rank))
        if curve is None:
            curve = self.curves[(shown, rank)] = Curve()
        return curve

    def _on_finished(self, event: RankFinished) -> None:
        row = self._row(event.rank)
        row.ended_at, row.exitcode = self.now(), event.exitcode
        row.state = rank_state(event)
        if event.failure is not None:
            row.error = clean_text(failure_line(event.failure))
            self.failures[event.rank] = event.failure

    def metrics_note(self) -> str | None:
        """What was logged but not kept, in a sentence; None when everything was kept."""
        if not self.values_not_kept:
            return None
        names = ", ".join(self.names_not_kept)
        return (
            f"{self.values_not_kept:,} value{'s' if self.values_not_kept != 1 else ''} logged "
            f"under metric names past the first {METRICS_KEPT:,} ({names}, …) were not kept"
        )

    def shown_curves(self) -> dict[tuple[str, int], Curve]:
        """The curves by the names they are shown under (metric names cleaned)."""
        return self.curves


def rank_state(event: RankFinished) -> str:
    """done, failed, stopped (or another word the launcher uses): the launcher's own word."""
    state = clean_text(event.state or "").strip()
    if not state or state in ("starting", "running"):
        return "failed"
    return state[:40]


def record_data(record: DashboardRecord) -> dict[str, Any]:
    """A finished (or running) launch as plain data: what ``launches()`` returns."""
    now = record.now()
    metrics: dict[str, dict[int, dict[str, list[float]]]] = {}
    for (name, rank), curve in sorted(record.shown_curves().items()):
        steps, values = curve.points()
        metrics.setdefault(name, {})[rank] = {
            "steps": steps,
            "values": values,
            "logged": curve.calls,  # type: ignore[dict-item]
        }
    ranks = []
    for rank in sorted(record.rows):
        row = record.rows[rank]
        failure = record.failures.get(rank)
        ranks.append({
            "rank": rank, "state": row.state, "device": row.device, "pid": row.pid,
            "elapsed": row.elapsed(now), "exitcode": row.exitcode, "error": row.error,
            "where": row.where,
            "traceback": clean_text(cut_lines(failure.traceback)) if failure is not None else None,
            "progress": None if row.progress is None else {
                "n": row.progress.n, "total": row.progress.total, "description": row.progress.description,
            },
            "last_metrics": dict(row.last_metrics), "last_line": row.last_line,
            "peak_memory": None if row.memory is None else {
                "kind": row.memory.kind, "peak_bytes": row.memory.peak_bytes,
                "current_bytes": row.memory.current_bytes, "device": row.memory.device,
                "rss_bytes": row.memory.rss_bytes,
            },
            "steps": None if row.steps is None else dict(row.steps),
        })  # fmt: skip
    found = record.diagnosis()
    machine = record.machine_memory
    return {
        "outcome": record.outcome, "elapsed": record.elapsed, "started_at": record.wall_started_at,
        "ended_at": record.ended_at, "num_processes": record.num_processes,
        "accelerator": record.accelerator, "mixed_precision": record.mixed_precision,
        "start_method": record.start_method, "ranks": ranks, "metrics": metrics,
        "values_not_kept": record.values_not_kept,
        "diagnosis": None if found is None else found.sentence,
        "speedup": None if found is None else found.speedup,
        "machine_memory": None if machine is None else {
            "used_bytes": machine.used_bytes, "total_bytes": machine.total_bytes,
        },
    }  # fmt: skip


def failure_line(failure: RankFailure) -> str:
    """The first line of what went wrong, e.g. ``ValueError: learning rate too large``."""
    if failure.exception_type:
        text = (
            f"{failure.exception_type}: {failure.message}"
            if failure.message
            else failure.exception_type
        )
    else:
        text = re.sub(r"^Rank \d+ (\(pid \d+\) )?", "", failure.summary())
    lines = text.strip().splitlines()
    return lines[0] if lines else text


def _metric_name(name: Any) -> str:
    text = clean_text(str(name)).strip() or "(unnamed)"
    return text if len(text) <= 200 else text[:199] + "…"


def _number(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
