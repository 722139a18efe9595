"""Where ``Accelerator.log`` sends metrics (kept apart from the core so that a rank can
forward them without importing torch-heavy modules).

The training core knows nothing of the launcher; a launcher (or a user) that wants the
metrics registers a sink here, e.g. one that forwards them as launch events to the
notebook's live plot. Without a sink, ``log`` only keeps them in ``Accelerator.logged``.
"""

from __future__ import annotations

from typing import Any, Callable

MetricSink = Callable[[int, "int | None", "dict[str, Any]"], None]  # (rank, step, values)

_sinks: list[MetricSink] = []


def add_metric_sink(sink: MetricSink) -> None:
    if sink not in _sinks:
        _sinks.append(sink)


def remove_metric_sink(sink: MetricSink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def emit(rank: int, step: int | None, values: dict[str, Any]) -> None:
    for sink in list(_sinks):
        sink(rank, step, values)


# A sink may hold metrics back for a moment to send them in batches; the training core
# flushes before it blocks (a barrier), where a rank may wait long or be stopped.
_flushes: list[Callable[[], None]] = []


def add_metric_flush(flush: Callable[[], None]) -> None:
    if flush not in _flushes:
        _flushes.append(flush)


def flush_metrics() -> None:
    for flush in list(_flushes):
        flush()


# Progress of the training core's tqdm bars, by the same route: (rank, n, total, description).
ProgressSink = Callable[[int, int, "int | None", str], None]

_progress_sinks: list[ProgressSink] = []


def add_progress_sink(sink: ProgressSink) -> None:
    if sink not in _progress_sinks:
        _progress_sinks.append(sink)


def has_progress_sink() -> bool:
    return bool(_progress_sinks)


def emit_progress(rank: int, n: int, total: int | None, description: str) -> None:
    for sink in list(_progress_sinks):
        sink(rank, n, total, description)


# The training core's step anatomy (``accelerator.step_timing``), by the same route: (rank,
# {"count", "median_s", "compute_s", "collectives_s", "data_s"}). A rank asks for the last
# summaries with ``finish_steps`` before it reports how it ended.
StepsSink = Callable[[int, "dict[str, Any]"], None]

_steps_sinks: list[StepsSink] = []
_steps_finals: list[Callable[[], None]] = []


def add_steps_sink(sink: StepsSink) -> None:
    if sink not in _steps_sinks:
        _steps_sinks.append(sink)


def emit_steps(rank: int, summary: dict[str, Any]) -> None:
    for sink in list(_steps_sinks):
        sink(rank, summary)


def add_steps_final(final: Callable[[], None]) -> None:
    if final not in _steps_finals:
        _steps_finals.append(final)


def finish_steps() -> None:
    for final in list(_steps_finals):
        final()
