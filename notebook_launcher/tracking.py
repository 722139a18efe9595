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
