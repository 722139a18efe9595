"""Metric events as the launcher sends them, for tests of what observers make of them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from notebook_launcher.launcher.events import RankMetrics
from notebook_launcher.launcher.metric_batch import MetricBatch, numbers_of


def logged(rank: int, values: dict[str, Any], step: int | None) -> RankMetrics:
    """One ``Accelerator.log`` call of one rank, arriving alone: its numbers, as the rank
    sends them (text and ints too large for a float stay behind)."""
    return RankMetrics(rank, MetricBatch.of_calls([step], [numbers_of(values)]))


def in_batches(events: Iterable[RankMetrics], size: int) -> Iterator[RankMetrics]:
    """The same calls arriving ``size`` at a time, as the launcher passes on calls that
    reach the kernel together: one event per rank and batch, each rank's calls in order."""
    events = list(events)
    for start in range(0, len(events), size):
        by_rank: dict[int, tuple[list[int | None], list[dict[str, float]]]] = {}
        for event in events[start : start + size]:
            steps, calls = by_rank.setdefault(event.rank, ([], []))
            steps += event.batch.steps
            calls += event.batch.calls()
        for rank, (steps, calls) in by_rank.items():
            yield RankMetrics(rank, MetricBatch.of_calls(steps, calls))
