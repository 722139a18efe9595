"""Watching running ranks from the calling thread until every one has ended.

One ``select`` loop over every rank's output pipes, message channel and exit sentinel:
no helper threads, so nothing is left running in the kernel and everything observers
print lands in the calling cell. The first failure stops the other ranks at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import time
from typing import Any, Callable

import cloudpickle

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.channel import Failure, Metric, Progress, Result
from notebook_launcher.launcher.events import (
    LaunchEvent,
    OutputLine,
    RankFinished,
    RankMetric,
    RankProgress,
)
from notebook_launcher.launcher.processes import RankProcess, stop_all

_READ_CHUNK = 1 << 16
# After a rank exits, what it started may still hold its pipes open this long.
_DRAIN_GRACE_S = 1.0


@dataclasses.dataclass
class Outcome:
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    failures: list[RankFailure] = dataclasses.field(default_factory=list)
    remote_exceptions: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    timed_out_ranks: list[int] = dataclasses.field(default_factory=list)
    stopped_from_outside: bool = False


class Monitor:
    def __init__(
        self,
        ranks: list[RankProcess],
        emit: Callable[[LaunchEvent], None],
        *,
        poll_interval: float,
        deadline: float | None,
        stop_requested: Callable[[], bool],
        grace_s: float,
    ) -> None:
        self._ranks = ranks
        self._emit = emit
        self._poll_interval = poll_interval
        self._deadline = deadline
        self._stop_requested = stop_requested
        self._grace_s = grace_s
        self._kill_at: float | None = None
        self._outcome = Outcome()

    def run(self) -> Outcome:
        with selectors.DefaultSelector() as selector:
            for rank in self._ranks:
                for fd in rank.streams:
                    selector.register(fd, selectors.EVENT_READ, (rank, "stream"))
                selector.register(rank.channel.fileno(), selectors.EVENT_READ, (rank, "channel"))
                selector.register(rank.process.sentinel, selectors.EVENT_READ, (rank, "exit"))
            while self._busy(selector):
                for key, _ in selector.select(self._next_timeout()):
                    rank, kind = key.data
                    # A key may be stale: handling an exit earlier in this batch drains it.
                    if kind == "stream":
                        if key.fd in rank.streams:
                            self._read_stream(selector, rank, key.fd)
                    elif kind == "channel":
                        if not rank.channel.closed:
                            self._read_channel(selector, rank)
                    else:
                        self._on_exit(selector, rank)
                self._check_limits()
        return self._outcome

    def _busy(self, selector: selectors.BaseSelector) -> bool:
        if any(rank.running for rank in self._ranks):
            return True
        last_exit = max(rank.exited_at or 0.0 for rank in self._ranks)
        if selector.get_map() and time.monotonic() - last_exit < _DRAIN_GRACE_S:
            return True
        for rank in self._ranks:  # whatever still holds a pipe is stopped; take what it wrote
            rank.signal(signal.SIGKILL)
            for fd in list(rank.streams):
                self._read_stream(selector, rank, fd, until_eof=True)
        return False

    def _next_timeout(self) -> float:
        timeout = self._poll_interval
        now = time.monotonic()
        for moment in (self._deadline, self._kill_at):
            if moment is not None:
                timeout = min(timeout, max(0.0, moment - now))
        return timeout

    def _read_stream(
        self, selector: selectors.BaseSelector, rank: RankProcess, fd: int, until_eof: bool = False
    ) -> None:
        stream = rank.streams[fd]
        while True:
            try:
                data = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                if not until_eof:
                    return
                data = b""  # the writer is gone or stopped: what was there is read
            if not data:
                pieces = rank.splitters[stream].close()
                selector.unregister(fd)
                rank.close_stream(fd)
            else:
                pieces = rank.splitters[stream].feed(data)
            for text, is_progress in pieces:
                if not is_progress:
                    rank.tail.append(text)
                self._emit(OutputLine(rank.rank, stream, text, is_progress))
            if not data or len(data) < _READ_CHUNK:
                return

    def _read_channel(self, selector: selectors.BaseSelector, rank: RankProcess) -> None:
        try:
            message = rank.channel.recv()
        except (EOFError, OSError):
            selector.unregister(rank.channel.fileno())
            rank.channel.close()
            return
        if isinstance(message, (Result, Failure)):
            rank.messages.append(message)
        elif isinstance(message, Progress):
            self._emit(RankProgress(rank.rank, message.n, message.total, message.description))
        elif isinstance(message, Metric):
            self._emit(RankMetric(rank.rank, message.values, message.step))

    def _on_exit(self, selector: selectors.BaseSelector, rank: RankProcess) -> None:
        selector.unregister(rank.process.sentinel)
        rank.process.join()
        rank.exited_at = time.monotonic()
        # The rank wrote its last message before exiting: take it before judging the exit.
        while not rank.channel.closed and rank.channel.poll():
            self._read_channel(selector, rank)
        failure = self._judge(rank)
        if failure is not None:
            self._outcome.failures.append(failure)
            if self._kill_at is None:
                self._stop_others()
        self._emit(RankFinished(rank.rank, rank.exitcode, failure))

    def _judge(self, rank: RankProcess) -> RankFailure | None:
        exitcode = rank.exitcode
        for message in rank.messages:
            if isinstance(message, Failure):
                self._keep_remote_exception(rank.rank, message.exception)
                return RankFailure(
                    rank.rank, rank.pid, exitcode, message.exception_type, message.message,
                    message.traceback, time=message.time,
                )
            if isinstance(message, Result) and exitcode == 0:
                self._outcome.results[rank.rank] = message
                return None
        if rank.stop_sent:
            return None  # ended because the launcher stopped it
        return RankFailure(
            rank.rank, rank.pid, exitcode, output_tail=crash_excerpt(list(rank.tail)), time=time.time()
        )

    def _keep_remote_exception(self, rank: int, pickled: bytes | None) -> None:
        if pickled is None:
            return
        with contextlib.suppress(Exception):  # its class may not exist in the kernel
            self._outcome.remote_exceptions[rank] = cloudpickle.loads(pickled)

    def _stop_others(self) -> None:
        stop_all(self._ranks)
        self._kill_at = time.monotonic() + self._grace_s

    def _check_limits(self) -> None:
        now = time.monotonic()
        if self._kill_at is not None:
            if now >= self._kill_at:
                stop_all(self._ranks, signal.SIGKILL)
            return
        if self._deadline is not None and now >= self._deadline:
            self._outcome.timed_out_ranks = [r.rank for r in self._ranks if r.running]
            self._stop_others()
        elif self._stop_requested():
            self._outcome.stopped_from_outside = True
            self._stop_others()



def crash_excerpt(lines: list[str], keep: int = 20) -> str:
    """The part of a crashed rank's last output worth showing: faulthandler's report
    (innermost frames first) when there is one, else the last lines."""
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return "\n".join(lines[index : index + keep])
    return "\n".join(lines[-keep:])
