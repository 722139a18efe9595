"""Finding what ranks started, even what left their process groups (daemons, setsid).

Every rank's environment carries its launch's id (``NOTEBOOK_LAUNCHER_LAUNCH_ID``), and
every program a rank starts inherits it. A double-forked daemon is no longer the rank's
child nor in its process group, but its environment still says which launch it came
from, so closing a launch ends it too. Linux only (``/proc``); elsewhere a rank's
process group is what is ended.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections.abc import Callable, Collection

from notebook_launcher import rank_env

_PROC = "/proc"
# SIGKILL to "this process would not die": the kernel ends a killed process at once, unless
# it is stuck in the kernel (a driver call, a dead network mount).
KILL_WAIT_S = 5.0


def marked_processes(launch_id: str, proc: str = _PROC) -> list[int]:
    """Pids of this user's processes whose environment names ``launch_id``."""
    marker = f"{rank_env.LAUNCH_ID}={launch_id}".encode()
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    me, uid = os.getpid(), os.getuid()
    found: list[int] = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        path = os.path.join(proc, entry)
        try:
            if os.stat(path).st_uid != uid:
                continue  # not ours to end (nor readable)
            with open(os.path.join(path, "environ"), "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if marker in variables:
            found.append(int(entry))
    return found


def end_marked_processes(
    launch_id: str, wait_s: float = 0.0, spare: Collection[int] = (), proc: str = _PROC
) -> list[int]:
    """SIGKILL every process marked with ``launch_id`` but those in ``spare``; returns the
    pids signalled. With ``wait_s``, waits up to that long until they have ended."""
    return _end(lambda: marked_processes(launch_id, proc), wait_s, spare)


def _end(find: Callable[[], list[int]], wait_s: float, spare: Collection[int] = ()) -> list[int]:
    """SIGKILL what ``find`` finds, again until it finds nothing new, then wait for the ends.

    A daemon that still holds a port or a device once its launch is over would fail the
    next launch: hence the wait. Each process is held by a pidfd from before its signal, so
    a pid reused meanwhile is never signalled nor waited for. A process may start another
    while it is being ended: hence the search again.
    """
    deadline = time.monotonic() + wait_s
    signalled: list[int] = []
    handles: list[int] = []
    try:
        while True:
            fresh = [pid for pid in find() if pid not in signalled and pid not in spare]
            if not fresh:
                break
            for pid in fresh:
                signalled.append(pid)
                handle = _kill(pid)
                if handle is not None:
                    handles.append(handle)
            if time.monotonic() >= deadline:
                break
        _wait_ended(handles, deadline)
    finally:
        for handle in handles:
            os.close(handle)
    return signalled


def _kill(pid: int) -> int | None:
    """SIGKILL ``pid``; returns a pidfd that becomes readable when it has ended, if any."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return None  # ended meanwhile
    except (OSError, AttributeError):  # no pidfds (kernel before 5.3, not Linux): signal by pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        return None
    try:
        signal.pidfd_send_signal(handle, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return handle


def _wait_ended(handles: list[int], deadline: float) -> None:
    pending = set(handles)
    with selectors.DefaultSelector() as selector:
        for handle in pending:
            selector.register(handle, selectors.EVENT_READ)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for key, _ in selector.select(left):
                pending.discard(key.fd)
                selector.unregister(key.fd)


def descendants_of(pid: int, proc: str = _PROC) -> list[int]:
    """Every process below ``pid`` in the process tree (children first), from /proc.

    Walks each process's ``task/*/children`` lists (cheap: a rank that started nothing
    reads one short file per thread); where the kernel has no such lists, scans every
    process's parent instead.
    """
    if not os.path.exists(os.path.join(proc, str(pid), "task", str(pid), "children")):
        return _descendants_by_scan(pid, proc)
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in _children(queue.pop(), proc):
            found.append(child)
            queue.append(child)
    return found


def _children(pid: int, proc: str) -> list[int]:
    tasks = os.path.join(proc, str(pid), "task")
    children: list[int] = []
    try:
        threads = os.listdir(tasks)
    except OSError:  # gone meanwhile
        return []
    for thread in threads:
        try:
            with open(os.path.join(tasks, thread, "children"), "rb") as listing:
                children += [int(child) for child in listing.read().split()]
        except (OSError, ValueError):
            continue
    return children


def _descendants_by_scan(pid: int, proc: str) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat"), "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def end_descendants(pid: int | None = None, wait_s: float = 0.0) -> list[int]:
    """SIGKILL every process below ``pid`` (this process by default); returns the pids
    signalled. With ``wait_s``, waits up to that long until they have ended."""
    below = os.getpid() if pid is None else pid
    return _end(lambda: descendants_of(below), wait_s)
