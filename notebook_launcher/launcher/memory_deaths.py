"""Whether a rank killed by SIGKILL was killed by the kernel's OOM killer, and at what limit.

The kernel counts the processes its OOM killer ends in each memory cgroup (``oom_kill`` in
``memory.events`` under cgroup v2, in ``memory.oom_control`` under v1), for the victim's
cgroup and every cgroup above it, whichever limit was hit: the cgroup's own, an ancestor's
(a container's), or the machine's RAM. So the counter of the rank's own cgroup, read when
the rank starts and again when it is found killed, says whether the OOM killer took a
process there meanwhile. The limit named is the smallest on the way up from the rank's
cgroup, else the machine's RAM. Where no counter can be read (no cgroup filesystem, a
container that hides it), the kernel log says it, where it can be read.

Reads files only; every failure to read means "not known", never an error.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from notebook_launcher.rank_memory import format_bytes, machine_memory

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a number near 2**63
_MOUNTINFO = "/proc/self/mountinfo"


@dataclasses.dataclass(frozen=True)
class CgroupWatch:
    """A rank's memory cgroup, and its OOM kill counter when the watch began."""

    version: int  # 1 or 2
    name: str  # as /proc/<pid>/cgroup names it: /process_api/abc
    directory: Path
    mount: Path  # the hierarchy's root directory (no limit is looked for above it)
    oom_kills: int


def watch(pid: int, proc: str = "/proc", mountinfo: str = _MOUNTINFO) -> list[CgroupWatch]:
    """The memory cgroups of process ``pid`` (v1 and v2 may both count), counters read now."""
    return GroupWatch(proc, mountinfo).watch(pid)


class GroupWatch:
    """Watches for the ranks of one launch, each distinct cgroup read once.

    Ranks started by one kernel are members of its cgroups: the mount table and the
    counters are read for the first rank and the others, members of the same cgroups,
    share its watch.
    """

    def __init__(self, proc: str = "/proc", mountinfo: str = _MOUNTINFO) -> None:
        self._proc, self._mountinfo = proc, mountinfo
        self._mounts: dict[int, tuple[str, str]] | None = None
        self._by_membership: dict[str, list[CgroupWatch]] = {}

    def watch(self, pid: int) -> list[CgroupWatch]:
        try:
            membership = Path(f"{self._proc}/{pid}/cgroup").read_text()
        except OSError:
            return []
        if membership not in self._by_membership:
            if self._mounts is None:
                self._mounts = _mounts(self._mountinfo)
            self._by_membership[membership] = _watches(membership.splitlines(), self._mounts)
        return self._by_membership[membership]


def _watches(lines: list[str], mounts: dict[int, tuple[str, str]]) -> list[CgroupWatch]:
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, name = parts
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else 0
        mount = mounts.get(version)
        if mount is None:
            continue
        root, mount_point = mount
        relative = name[len(root) :] if root != "/" and name.startswith(root) else name
        directory = Path(mount_point) / relative.lstrip("/")
        kills = _oom_kills(version, directory)
        if kills is not None:
            found.append(CgroupWatch(version, name, directory, Path(mount_point), kills))
    return found


def oom_reason(
    watches: list[CgroupWatch],
    pid: int | None,
    rss_bytes: int | None,
    since: float,
    kmsg: str = "/dev/kmsg",
) -> str | None:
    """Why the OOM killer ended the process (the limit, its last resident memory), in
    words; None when neither its cgroups' counters nor the kernel log say it did.
    ``since``: ``time.monotonic()`` when the process started (older log lines name
    another process that had the same pid)."""
    for seen in watches:
        kills = _oom_kills(seen.version, seen.directory)
        if kills is not None and kills > seen.oom_kills:
            return _words(_limit(seen), rss_bytes)
    if not watches and pid is not None and _kernel_log_says_killed(pid, since, kmsg):
        return _words(None, rss_bytes)
    return None


def _words(limit: tuple[str, int] | None, rss_bytes: int | None) -> str:
    if limit is None:
        machine = machine_memory()
        what = (
            f"the machine's RAM ({format_bytes(machine.total_bytes)})"
            if machine is not None
            else "the machine's RAM"
        )
    else:
        where, size = limit
        what = f"the memory limit of {format_bytes(size)} of its cgroup {where}"
    last = (
        f"; its last resident memory (RSS) reported was {format_bytes(rss_bytes)}"
        if rss_bytes is not None
        else ""
    )
    return f"out of memory: the kernel's OOM killer ended it at {what}{last}"


def _limit(seen: CgroupWatch) -> tuple[str, int] | None:
    """The smallest memory limit from the rank's cgroup up to its hierarchy's root."""
    smallest: tuple[str, int] | None = None
    directory = seen.directory
    while True:
        size = _read_limit(seen.version, directory)
        if size is not None and (smallest is None or size < smallest[1]):
            smallest = (str(directory), size)
        if directory == seen.mount or directory.parent == directory:
            break
        directory = directory.parent
    machine = machine_memory()
    if smallest is not None and machine is not None and smallest[1] >= machine.total_bytes:
        return None  # a limit above the machine's RAM: the RAM ran out first
    return smallest


def _read_limit(version: int, directory: Path) -> int | None:
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max"
    size = int(text)
    return size if size < _NO_LIMIT else None


def _oom_kills(version: int, directory: Path) -> int | None:
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        text = (directory / name).read_text()
    except OSError:
        return None
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _mounts(mountinfo: str) -> dict[int, tuple[str, str]]:
    """Cgroup version -> (root inside the hierarchy, mount point) of the memory hierarchies."""
    found: dict[int, tuple[str, str]] = {}
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.setdefault(2, (root, mount_point))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.setdefault(1, (root, mount_point))
    return found


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _kernel_log_says_killed(pid: int, since: float, kmsg: str) -> bool:
    """Whether the kernel log holds "Killed process <pid>" logged after ``since`` (a
    ``time.monotonic()``; the log's records carry the same clock, in microseconds)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    wanted = re.compile(
        rb"^\d+,\d+,(\d+),[^;]*;.*Killed process " + str(pid).encode() + rb"\b",
        re.MULTILINE,
    )
    try:
        for _ in range(100_000):  # the log's records, one a read; a bound, never reached
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False  # read to the end
            except OSError:
                continue  # a record overwritten while reading (EPIPE): go on
            if not record:
                return False
            found = wanted.search(record)
            if found and int(found.group(1)) / 1e6 >= since - 1.0:
                return True
    finally:
        os.close(fd)
    return False
