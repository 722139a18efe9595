"""What a rank is doing right now: where its code is, how long it has run, what it holds.

Taken on the rank by a side thread (see ``rank_signals.SignalWatch``) when the kernel asks with
SIGUSR1, from ``sys._current_frames()``: a main thread blocked inside a C++ collective still
shows its Python frames, so a rank stuck in ``all_reduce`` can say so (the rule of what is
where: ``notebook_launcher.stack_location``, which a launch's ranks use too). Nothing here
runs unless asked; a cell pays nothing for it.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from typing import Any, Callable

from notebook_launcher.session.protocol import Snapshot
from notebook_launcher.stack_location import main_thread_frame, where_line


@dataclasses.dataclass(frozen=True)
class Running:
    """The command a rank's main thread runs now."""

    what: str  # "cell 5", "a function", "push", ...
    started: float  # time.monotonic() on the rank


class SnapshotTaker:
    """Kept by the rank's side thread: the CPU time it last saw, for the next look's CPU %."""

    def __init__(self, main_thread_id: int) -> None:
        self._main = main_thread_id
        self._last_cpu = _cpu_seconds()
        self._last_time = time.monotonic()

    def take(
        self, running: Running | None, is_cell: Callable[[str], bool], device: Any
    ) -> Snapshot:
        now, cpu = time.monotonic(), _cpu_seconds()
        elapsed = max(now - self._last_time, 1e-6)
        cpu_percent = 100.0 * max(cpu - self._last_cpu, 0.0) / elapsed
        self._last_cpu, self._last_time = cpu, now
        where = ""
        if running is not None:
            frame = main_thread_frame(self._main)
            where = where_line(frame, is_cell) if frame is not None else "not in Python code"
        allocated, reserved = _cuda_memory(device)
        return Snapshot(
            pid=os.getpid(),
            running=None if running is None else running.what,
            running_s=None if running is None else now - running.started,
            where=where,
            rss_bytes=_rss_bytes(),
            cpu_percent=round(cpu_percent, 1),
            cuda_allocated_bytes=allocated,
            cuda_reserved_bytes=reserved,
        )


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cuda_memory(device: Any) -> tuple[int | None, int | None]:
    torch = sys.modules.get("torch")
    if torch is None or getattr(device, "type", None) != "cuda" or not torch.cuda.is_initialized():
        return None, None
    try:
        return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))
    except Exception:
        return None, None


# The kernel's side: how a snapshot reads ----------------------------------------------


def status_row(rank: int, snapshot: Snapshot | None) -> dict[str, Any]:
    """One rank's status as plain data (``Session.status()``)."""
    if snapshot is None:
        return {"rank": rank, "state": "not answering", "pid": None}
    return {
        "rank": rank,
        "state": "idle" if snapshot.running is None else "running",
        "running": snapshot.running,
        "running_s": None if snapshot.running_s is None else round(snapshot.running_s, 3),
        "where": snapshot.where,
        "pid": snapshot.pid,
        "rss_bytes": snapshot.rss_bytes,
        "cpu_percent": snapshot.cpu_percent,
        "cuda_allocated_bytes": snapshot.cuda_allocated_bytes,
        "cuda_reserved_bytes": snapshot.cuda_reserved_bytes,
    }


def status_line(row: dict[str, Any]) -> str:
    """One rank's status as the magic prints it."""
    if row["pid"] is None:
        return f"rank {row['rank']}: {row['state']}"
    state = (
        "idle"
        if row["state"] == "idle"
        else f"running {row['running']} for {_duration(row['running_s'])}"
    )
    parts = [
        f"rank {row['rank']}: {state}",
        f"pid {row['pid']}",
        f"RSS {_size(row['rss_bytes'])}",
        f"CPU {row['cpu_percent']:.0f}%",
    ]
    if row["cuda_allocated_bytes"] is not None:
        parts.append(
            f"CUDA {_size(row['cuda_allocated_bytes'])} allocated, {_size(row['cuda_reserved_bytes'])} reserved"
        )
    return ", ".join(parts)


def where_text(rank: int, snapshot: Snapshot | None) -> str:
    if snapshot is None:
        return f"rank {rank}: did not answer"
    if snapshot.running is None:
        return f"rank {rank}: idle, waiting for the next cell"
    return f"rank {rank}: {snapshot.where}"


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest} s"
