"""What a rank is doing right now: where its code is, how long it has run, what it holds.

Taken on the rank by a side thread (see ``rank_signals.SignalWatch``) when the kernel asks with
SIGUSR1, from ``sys._current_frames()``: a main thread blocked inside a C++ collective still
shows its Python frames, so a rank stuck in ``all_reduce`` can say so. Nothing here runs
unless asked; a cell pays nothing for it.
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import linecache
import os
import re
import resource
import sys
import time
from types import CodeType, FrameType
from typing import Any, Callable

from notebook_launcher.session.protocol import Snapshot

_CELL_NAME = re.compile(r"In\[(\d+)\]\Z")
_COLLECTIVES = os.sep + os.path.join("torch", "distributed") + os.sep


@dataclasses.dataclass(frozen=True)
class Running:
    """The command a rank's main thread runs now."""

    what: str  # "cell 5", "a function", "push", ...
    started: float  # time.monotonic() on the rank


def cell_label(filename: str) -> str:
    """``In[5]`` (a notebook cell) -> ``cell 5``; other names as they are, without brackets."""
    found = _CELL_NAME.match(filename)
    return f"cell {found.group(1)}" if found else filename.strip("<>")


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
            frame = sys._current_frames().get(self._main)
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


def where_line(frame: FrameType, is_cell: Callable[[str], bool]) -> str:
    """One line: the innermost line of a notebook cell on the stack, and the function the
    code is in below it (or the call that line is making, when that is not Python code)."""
    stack: list[FrameType] = []
    inner: FrameType | None = frame
    while inner is not None:
        stack.append(inner)
        inner = inner.f_back
    innermost = stack[0]
    cell = next((f for f in stack if is_cell(f.f_code.co_filename)), None)
    if cell is None:  # e.g. a function of the package itself: its own file and line
        return f"{innermost.f_code.co_filename}, line {innermost.f_lineno}, in {_qualname(innermost.f_code)}"
    place = f"{cell_label(cell.f_code.co_filename)}, line {cell.f_lineno}"
    if cell.f_code.co_name != "<module>":
        place += f" (in {_qualname(cell.f_code)})"
    if innermost is cell:
        called = _called_name(cell)
        return f"{place}, in {called}" if called else place
    line = f"{place}, in {_qualname(innermost.f_code)}"
    if _COLLECTIVES in innermost.f_code.co_filename:
        line += " (waiting for the others)"
    return line


def _qualname(code: CodeType) -> str:
    """``Class.method`` where Python says it (3.11 and later), the bare name on 3.10."""
    return getattr(code, "co_qualname", code.co_name)


def _called_name(frame: FrameType) -> str:
    """What the frame's current instruction calls (``time.sleep``), read from the source
    span that instruction came from; empty when that cannot be told."""
    try:
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset != frame.f_lasti:
                continue
            # Python 3.11 and later know each instruction's columns; 3.10 names no call.
            position = getattr(instruction, "positions", None)
            if position is None or position.lineno is None or position.end_lineno is None:
                return ""
            lines = linecache.getlines(frame.f_code.co_filename)[
                position.lineno - 1 : position.end_lineno
            ]
            if not lines or position.col_offset is None or position.end_col_offset is None:
                return ""
            if len(lines) == 1:
                source = lines[0].encode()[position.col_offset : position.end_col_offset].decode()
            else:
                source = "".join(
                    [
                        lines[0].encode()[position.col_offset :].decode(),
                        *lines[1:-1],
                        lines[-1].encode()[: position.end_col_offset].decode(),
                    ]
                )
            call = ast.parse(source.strip(), mode="eval").body
            if isinstance(call, ast.Call):
                return ast.unparse(call.func)
            return ""
    except Exception:  # a source that changed, an odd instruction: say nothing rather than wrong
        return ""
    return ""


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
