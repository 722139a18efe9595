"""``Accelerator.log`` calls as they travel to the kernel and reach its observers.

A rank logging in a tight loop sends thousands of calls at once. Kept as one dict per call,
each value would cost the kernel about half a microsecond to unpickle; kept as one array of
floats per metric, a batch unpickles as a copy of bytes, and an observer (the dashboard)
takes a metric in as one column instead of value by value.
"""

from __future__ import annotations

import array
import dataclasses
import heapq
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any


def numbers_of(values: Mapping[str, Any]) -> dict[str, float]:
    """The values of one log call that travel: those that are numbers, as floats, under
    their names as text.

    Others (text, a histogram, an int too large for a float) stay with the trackers.
    """
    numbers: dict[str, float] = {}
    for name, value in values.items():
        try:
            numbers[name if isinstance(name, str) else str(name)] = float(value)
        except (TypeError, ValueError, ArithmeticError, RuntimeError):
            pass
    return numbers


def step_of(step: Any) -> float | None:
    """The step of a log call as it travels: an int (a tensor or numpy int becomes one), a
    finite float (a fraction of an epoch), or None for anything else (no step)."""
    if step is None:
        return None
    try:
        return operator.index(step)
    except TypeError:
        pass
    if isinstance(step, (str, bytes)):
        return None
    try:
        value = float(step)
    except (TypeError, ValueError, ArithmeticError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class MetricColumn:
    """One metric's values in a batch, in the order logged."""

    values: array.array  # of floats ("d")
    calls: array.array | None  # indexes of the batch's calls that logged it; None: every call
    finite: bool  # True: no NaN or inf among the values (False: some may be)


@dataclasses.dataclass(frozen=True)
class MetricBatch:
    """Log calls of one rank, in order: call ``i`` was made at ``steps[i]`` (None: without
    a step) and logged, for each column that lists it, that column's value."""

    steps: Sequence[float | None]
    columns: dict[str, MetricColumn]  # names in the order first logged

    @classmethod
    def of_calls(
        cls, steps: Sequence[float | None], calls: Sequence[Mapping[str, float]]
    ) -> MetricBatch:
        """The batch of these calls (``calls[i]`` logged at ``steps[i]``), values as floats."""
        if len(steps) != len(calls):
            raise ValueError(f"{len(steps)} steps for {len(calls)} calls")
        columns: dict[str, MetricColumn] = {}
        if calls:
            first = calls[0]
            if len(first) * len(calls) == sum(map(len, calls)):
                try:  # every call logged the same names: the usual case, without looking at each
                    columns = {
                        name: _column(map(operator.itemgetter(name), calls), None) for name in first
                    }
                except KeyError:
                    columns = {}
            if not columns:
                columns = _sparse_columns(calls)
        return cls(_compact_steps(steps), columns)

    def __len__(self) -> int:
        return len(self.steps)

    def steps_of(self, column: MetricColumn) -> Sequence[float | None]:
        """The steps of the calls that logged ``column``'s values, in order."""
        if column.calls is None:
            return self.steps
        return list(map(self.steps.__getitem__, column.calls))

    def calls(self) -> list[dict[str, float]]:
        """One dict per call, as logged."""
        logged: list[dict[str, float]] = [{} for _ in self.steps]
        for name, column in self.columns.items():
            for index, value in zip(column.calls or range(len(logged)), column.values):
                logged[index][name] = value
        return logged


def _sparse_columns(calls: Sequence[Mapping[str, float]]) -> dict[str, MetricColumn]:
    # Calls grouped by the names they logged, each group's values taken column by column: a
    # few metrics every call beside hundreds every tenth call (per-layer norms, say) cost a
    # pass over the values, not names x calls.
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, call in enumerate(calls):
        group = groups.get(names := tuple(call))
        if group is None:
            groups[names] = [index]
        else:
            group.append(index)
    # Groups in the order first seen, so names come in the order first logged.
    pieces: dict[str, list[tuple[list[int], list[float]]]] = {}
    for names, indexes in groups.items():
        logged = [calls[index] for index in indexes]
        for name in names:
            pieces.setdefault(name, []).append(
                (indexes, list(map(operator.itemgetter(name), logged)))
            )
    columns: dict[str, MetricColumn] = {}
    for name, parts in pieces.items():
        if len(parts) == 1:
            ((indexes, values),) = parts
        else:  # logged in calls of several kinds: back into the order of the calls
            merged = list(heapq.merge(*(zip(indexes, values) for indexes, values in parts)))
            indexes, values = [index for index, _ in merged], [value for _, value in merged]
        columns[name] = _column(values, array.array("q", indexes))
    return columns


def _column(values: Any, calls: array.array | None) -> MetricColumn:
    column = array.array("d", values)
    total = sum(column, 0.0)  # finite only if every value is (large ones may overflow it)
    return MetricColumn(column, calls, total - total == 0.0)


def _compact_steps(steps: Sequence[float | None]) -> Sequence[float | None]:
    # Steps that are all ints travel as 8 bytes each; None or a huge int keeps a list.
    try:
        return array.array("q", steps)  # type: ignore[type-var]
    except (TypeError, OverflowError):
        return list(steps)
