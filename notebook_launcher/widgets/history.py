"""The launches this kernel ran with a dashboard, kept as records (the last few only).

``launches()`` returns them as plain data; the dashboard of the next launch draws the
previous launch's curves faded beside its own.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from notebook_launcher.widgets.record import DashboardRecord, record_data

KEPT = 20

_records: collections.deque[DashboardRecord] = collections.deque(maxlen=KEPT)
_lock = threading.Lock()


def keep(record: DashboardRecord) -> None:
    with _lock:
        if record not in _records:
            _records.append(record)


def previous() -> DashboardRecord | None:
    """The last launch kept, if it logged any metric."""
    with _lock:
        for record in reversed(_records):
            if record.curves:
                return record
    return None


def launches() -> list[dict[str, Any]]:
    """The last launches of this kernel (oldest first), each as plain data.

    Each is a dict: ``outcome`` ("ok", "failed", "timeout", "interrupted", ...),
    ``elapsed`` (s), ``started_at`` / ``ended_at`` (seconds since the epoch),
    ``num_processes``, ``accelerator``, ``mixed_precision``, ``start_method``, ``ranks``
    (one dict per rank: ``state``, ``elapsed`` (from the launch's start), ``exitcode``,
    ``error``, ``traceback``, ``where`` (where a rank still running was when ``timeout=``
    or a stop ended the launch: ``"was in cell 5, line 3 (in train), in all_reduce (waiting
    for the others)"``, or ``"did not say where it was"``; None otherwise), ``progress``,
    ``last_metrics`` (each metric's last value,
    exactly), ``peak_memory`` (``kind`` "rss" or "cuda", ``peak_bytes``,
    ``current_bytes``, ``device``; None before the rank reported), ...) and ``metrics``
    (``{name: {rank: {"steps": [...], "values": [...], "logged": n}}}``; past 4,000
    points a curve keeps an evenly thinned subset that always ends with the last point
    logged, ``logged`` counts them all; the first 1,000 metric names are kept, and
    ``values_not_kept`` counts values logged under later ones). Only launches run with
    a dashboard (the default) are kept, the last 20.
    """
    with _lock:
        records = list(_records)
    return [record_data(record) for record in records]


def forget() -> None:
    with _lock:
        _records.clear()
