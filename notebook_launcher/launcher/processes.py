"""Starting rank processes and stopping them, whatever the start method.

Each rank gets two pipes for its stdout and stderr (read here at file-descriptor level)
and a one-way channel for structured messages. A rank leads its own process group, so
stopping it also stops what it started (data loader workers).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from notebook_launcher.launcher.lines import LineSplitter
from notebook_launcher.launcher.rank import RankSpec, run_rank

_TAIL_LINES = 200  # enough to hold a crash report of a deep stack


class RankProcess:
    """One started rank, seen from the kernel."""

    def __init__(self, context: BaseContext, spec: RankSpec, payload: Any) -> None:
        self.rank = spec.rank
        self.streams: dict[int, str] = {}  # read fd -> "stdout" / "stderr"
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.messages: list[Any] = []
        self.exited_at: float | None = None
        self.stop_sent = False  # the launcher asked it to stop: its end is not a failure
        self._closed = False
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        self.channel, channel_w = context.Pipe(duplex=False)
        child_ends = (Connection(stdout_w, readable=False), Connection(stderr_w, readable=False))
        try:
            self.process = context.Process(  # type: ignore[attr-defined]
                target=run_rank,
                args=(spec, payload, *child_ends, channel_w),
                name=f"notebook_launcher-rank{spec.rank}",
            )
            with _main_module_hidden(context.get_start_method() != "fork"):
                self.process.start()
        except BaseException:
            for fd in (stdout_r, stderr_r):
                os.close(fd)
            self.channel.close()
            raise
        finally:
            for end in (*child_ends, channel_w):
                end.close()
        self.pid: int = self.process.pid
        with contextlib.suppress(OSError):  # races the rank's own setpgid; either wins
            os.setpgid(self.pid, self.pid)
        for fd, name in ((stdout_r, "stdout"), (stderr_r, "stderr")):
            os.set_blocking(fd, False)
            self.streams[fd] = name

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def running(self) -> bool:
        return self.exited_at is None

    def signal(self, signum: int) -> None:
        """Signal the rank's whole process group (the rank alone if it has none yet)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)
            return
        if self.process.exitcode is None:  # not reaped: the pid is still this rank's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def close_stream(self, fd: int) -> None:
        self.streams.pop(fd, None)
        os.close(fd)

    def close(self, grace_s: float) -> None:
        """Make sure the rank and its group are gone, then free every descriptor."""
        if self._closed:
            return
        if self.process.exitcode is None:
            self.signal(signal.SIGTERM)
            self.process.join(grace_s)
        if self.process.exitcode is None:
            self.signal(signal.SIGKILL)
            self.process.join()
        self.signal(signal.SIGKILL)  # leftovers in the rank's group
        for fd in list(self.streams):
            self.close_stream(fd)
        self.channel.close()
        self.process.close()
        self._closed = True


@contextlib.contextmanager
def _main_module_hidden(hide: bool) -> Iterator[None]:
    """Keep fresh interpreters from re-running the calling script as their ``__main__``.

    multiprocessing re-imports the parent's main script in every spawned child, which
    re-runs an unguarded script's launch in each rank. Ranks receive the function and its
    arguments by value, so they never need that module.
    """
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__
    }
    if not hide or (not saved.get("__file__") and saved.get("__spec__") is None):
        yield
        return
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def stop_all(ranks: list[RankProcess], signum: int = signal.SIGTERM) -> None:
    for rank in ranks:
        if rank.running:
            rank.stop_sent = True
            rank.signal(signum)


def close_all(ranks: list[RankProcess], grace_s: float) -> None:
    """Stop every rank, SIGTERM first, then SIGKILL after one shared grace period."""
    deadline = time.monotonic() + grace_s
    try:
        stop_all(ranks)
        for rank in ranks:
            rank.close(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second interrupt while stopping: no more grace
        for rank in ranks:
            rank.close(0.0)
        raise
