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
import signal

from notebook_launcher import rank_env

_PROC = "/proc"


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


def end_marked_processes(launch_id: str, proc: str = _PROC) -> list[int]:
    """SIGKILL every process marked with ``launch_id``; returns the pids signalled."""
    pids = marked_processes(launch_id, proc)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids
