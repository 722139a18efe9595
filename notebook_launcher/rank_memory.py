"""How much memory this process holds, and the most it has held: read in a rank, as plain data.

On a CUDA rank the figure is torch's ``max_memory_allocated`` (what tensors took on the
rank's GPU); elsewhere it is the process's peak resident set size (RSS), which on a CPU
rank is where the tensors live. Reading never initialises CUDA: a rank that has not used
its GPU reports RSS. Kept free of heavy imports: the launcher's ranks import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import sys
from typing import Any

_STATUS = "/proc/self/status"


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """One reading of this process's memory, in bytes."""

    kind: str  # "rss" (the process's resident set) or "cuda" (torch's allocations on the GPU)
    peak_bytes: int
    current_bytes: int
    device: str  # "cpu", or "cuda:0" ...

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _status_bytes(field: str) -> int | None:
    """``VmHWM`` / ``VmRSS`` of /proc/self/status in bytes (Linux); None elsewhere."""
    try:
        with open(_STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_reading() -> MemoryReading:
    peak = _status_bytes("VmHWM")
    current = _status_bytes("VmRSS")
    if peak is None:  # not Linux: the kernel's own peak (bytes on macOS, KiB elsewhere)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return MemoryReading("rss", peak, current if current is not None else peak, "cpu")


def _cuda_in_use() -> Any:
    """torch, when this process has initialised CUDA already; else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():
            return torch
    return None


def read() -> MemoryReading:
    """This process's memory now: CUDA allocations on a rank using its GPU, else RSS."""
    torch = _cuda_in_use()
    if torch is not None:
        index = torch.cuda.current_device()
        return MemoryReading(
            "cuda",
            int(torch.cuda.max_memory_allocated(index)),
            int(torch.cuda.memory_allocated(index)),
            f"cuda:{index}",
        )
    return _rss_reading()


def reset_peak() -> None:
    """Start the peak over from what is held now.

    A forked rank begins with the kernel's pages resident and the kernel's peak on its
    books; resetting makes the peak the rank's own. Linux resets the RSS peak when "5" is
    written to /proc/self/clear_refs; where that is refused the peak stays as it was.
    """
    with contextlib.suppress(OSError):
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
    torch = _cuda_in_use()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats(torch.cuda.current_device())


def format_bytes(count: int | float | None) -> str:
    """``412 MB``, ``1.3 GB`` (powers of 1000, as the dashboard shows them)."""
    if count is None:
        return "-"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            value = count / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(count)} B"
