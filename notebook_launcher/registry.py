"""The launches running now on this machine, shared between kernels and the Jupyter server.

Each launch writes one small JSON record into the Jupyter runtime directory and removes
it when it ends; the server extension lists the records and asks for a stop by creating
a marker file next to a record, which the launch's monitor loop notices.

A record whose kernel is gone (killed, so it could not close its launch) is cleared by
the next listing: the sidebar's, or the next launch's on this machine. Its ranks died with
the kernel, but not what they started in a session of their own (a daemon); the listing
ends those too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class LaunchRecord:
    launch_id: str
    kernel_id: str | None
    kernel_pid: int
    num_processes: int
    accelerator: str
    mixed_precision: str
    start_method: str
    state: str  # "starting", "running" or "stopping"; a session also "idle" between cells
    started_at: float  # seconds since the epoch
    rank_pids: list[int] = dataclasses.field(default_factory=list)
    kind: str = (
        "launch"  # "launch" (one function, then done) or "session" (ranks kept across cells)
    )
    # The kernel's pid namespace: a record read from another one (a container's, through a
    # shared runtime directory) names a pid that means nothing here.
    pid_namespace: str = ""
    # A session's answer to the sidebar's "where?": one line per rank, and when it was made.
    where: list[str] = dataclasses.field(default_factory=list)
    where_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def registry_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "notebook_launcher" / "launches"


def current_kernel_id() -> str | None:
    """The id of the Jupyter kernel this process is, from its connection file's name.

    Read from the running kernel application itself, and only where one runs: ipykernel's
    ``get_connection_file`` imports ipykernel's debugger (debugpy) on some versions (6.17,
    as Colab and Kaggle ship), which writes ``PYDEVD_USE_FRAME_EVAL`` into the environment
    and prints pydevd's warnings, and a script that launches has no kernel to ask.
    """
    kernelapp = sys.modules.get("ipykernel.kernelapp")  # never imported here: only looked up
    app = getattr(kernelapp, "IPKernelApp", None)
    try:
        if app is None or not app.initialized():
            return None
        name = Path(app.instance().connection_file).name
    except Exception:  # an ipykernel without these: the record only lacks the kernel's id
        return None
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-") : -len(".json")]
    return None


class RegisteredLaunch:
    """The record of one running launch, owned by the kernel that runs it."""

    def __init__(self, record: LaunchRecord) -> None:
        with contextlib.suppress(Exception):  # the registry only helps: it never stops a launch
            list_launches()  # clears what launches of dead kernels left behind
        self.record = dataclasses.replace(record, pid_namespace=_pid_namespace())
        self._dir = registry_dir()
        self._path = self._dir / f"{record.launch_id}.json"
        self._stop_path = self._dir / f"{record.launch_id}{_STOP}"
        self._where_path = self._dir / f"{record.launch_id}{_WHERE}"
        self._write()

    def update(self, **changes: Any) -> None:
        self.record = dataclasses.replace(self.record, **changes)
        self._write()

    def stop_requested(self) -> bool:
        return self._stop_path.exists()

    def where_requested(self) -> bool:
        """Whether the sidebar asked where the ranks are since the last call (it asks once)."""
        try:
            self._where_path.unlink()
        except OSError:
            return False
        return True

    def close(self) -> None:
        for path in (self._path, self._stop_path, self._where_path):
            with contextlib.suppress(OSError):  # never written (a runtime dir unusable), or gone
                path.unlink()

    def _write(self) -> None:
        # The registry only feeds the sidebar: a read-only runtime dir must not stop a launch.
        with contextlib.suppress(OSError):
            self._dir.mkdir(parents=True, exist_ok=True)
            _atomic_write_json(self._path, self.record.to_dict())


def list_launches() -> list[LaunchRecord]:
    """Records of launches whose kernel is alive; records left by dead kernels are removed."""
    records: list[LaunchRecord] = []
    directory = registry_dir()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = LaunchRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if _pid_alive(record.kernel_pid):
            records.append(record)
        else:
            if record.pid_namespace and record.pid_namespace == _pid_namespace():
                _end_left_behind(record.launch_id)
            for stale in (path, *(path.with_suffix(marker) for marker in _MARKERS)):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
    return sorted(records, key=lambda r: r.started_at)


def request_stop(launch_id: str) -> bool:
    """Ask a running launch to stop its ranks; False when no such launch runs."""
    return _leave_marker(launch_id, _STOP)


def request_where(launch_id: str) -> bool:
    """Ask a running session where its ranks are; its record says so soon after. False when
    no such session runs (a launch of one function does not answer)."""
    return _leave_marker(launch_id, _WHERE, kinds=("session",))


# Files the server leaves next to a record, each a request its launch notices.
_STOP, _WHERE = ".stop", ".where"
_MARKERS = (_STOP, _WHERE)


def _leave_marker(launch_id: str, marker: str, kinds: tuple[str, ...] | None = None) -> bool:
    """Leave ``marker`` for a running launch (of one of ``kinds``); False when none runs."""
    if not launch_id.isalnum():  # it names a file: refuse anything path-like
        return False
    if not any(
        r.launch_id == launch_id and (kinds is None or r.kind in kinds) for r in list_launches()
    ):
        return False
    (registry_dir() / f"{launch_id}{marker}").write_text(str(time.time()))
    return True


def _end_left_behind(launch_id: str) -> None:
    """End the processes a launch of a dead kernel left: its ranks' daemons."""
    if not launch_id.isalnum():  # a record written by hand: it marks nothing of ours
        return
    # Below the registry, as the registry is below the launcher.
    from notebook_launcher import descendants

    with contextlib.suppress(Exception):  # a listing must not fail on it
        descendants.end_marked_processes(launch_id)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: no daemon is searched for anyway
        return ""


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed kernel its parent has not reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
