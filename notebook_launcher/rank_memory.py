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
    # The process's resident memory now, whatever ``kind`` is: a GPU rank holds host RAM too
    # (its model loaded before it moved, its data), which is what the machine runs out of.
    rss_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _status_bytes(*fields: str) -> list[int | None]:
    """``VmHWM`` / ``VmRSS`` ... of /proc/self/status in bytes, in one reading of the file
    (Linux: the kernel computes every field at each read); None for each elsewhere."""
    wanted = {field.encode(): field for field in fields}
    found: dict[str, int] = {}
    try:
        with open(_STATUS, "rb") as status:
            for line in status.read().split(b"\n"):
                name, _, value = line.partition(b":")
                if name in wanted:
                    found[wanted[name]] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return [None] * len(fields)
    return [found.get(field) for field in fields]


def _rss_reading() -> MemoryReading:
    peak, current = _status_bytes("VmHWM", "VmRSS")
    if peak is None:  # not Linux: the kernel's own peak (bytes on macOS, KiB elsewhere)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    current = current if current is not None else peak
    return MemoryReading("rss", peak, current, "cpu", current)


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
            _status_bytes("VmRSS")[0],
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


# Past this share of the machine's RAM in use, the dashboard warns: the next rank to load a
# model may be killed by the kernel's OOM killer.
MACHINE_RAM_WARNING = 0.85


@dataclasses.dataclass(frozen=True)
class MachineMemory:
    """The machine's RAM: in use (total less what the kernel says is available), and total."""

    used_bytes: int
    total_bytes: int

    @property
    def share(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def warning(self) -> bool:
        return self.share >= MACHINE_RAM_WARNING

    def text(self) -> str:
        """``RAM 18 of 24 GB (76%)``."""
        return (
            f"RAM {format_bytes(self.used_bytes)} of {format_bytes(self.total_bytes)} "
            f"({self.share:.0%})"
        )


def machine_memory(meminfo: str = "/proc/meminfo") -> MachineMemory | None:
    """The machine's RAM in use, from /proc/meminfo; None where it cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open(meminfo, encoding="ascii") as info:
            for line in info:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return MachineMemory(fields["MemTotal"] - fields["MemAvailable"], fields["MemTotal"])


def format_bytes(count: int | float | None) -> str:
    """``412 MB``, ``1.3 GB`` (powers of 1000, as the dashboard shows them)."""
    if count is None:
        return "-"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            value = count / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(count)} B"
