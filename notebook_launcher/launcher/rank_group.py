"""The kernel's side of a group of ranks: start them, run until an outcome, close.

In the manner of torch elastic's PContext: the group owns the template (start, run until
every rank ended or an outcome is reached, time-limited close) and a backend only starts
ranks and gives a control for each. Each rank's lifecycle is one explicit state owned by
:class:`Rank`; the select loop only multiplexes output pipes, message channels and exit
sentinels, from the calling thread (no helper threads, so whatever observers print lands
in the calling cell). A session drives the same group repeatedly with ``run(until=...)``
and ``watch()`` between its commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import time
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import cloudpickle

from notebook_launcher import descendants
from notebook_launcher.errors import LaunchCleanupWarning, LaunchError, RankFailure
from notebook_launcher.launcher import memory_deaths, whereabouts
from notebook_launcher.launcher.backends.base import (
    Backend,
    Ended,
    RankTarget,
    Started,
    start_ranks,
)
from notebook_launcher.launcher.channel import (
    Failure,
    Hello,
    Memory,
    Progress,
    Result,
    Steps,
    Whereabouts,
)
from notebook_launcher.launcher.events import (
    LaunchEvent,
    OutputLine,
    RankFinished,
    RankMemory,
    RankMetrics,
    RankProgress,
    RankStarted,
    RankSteps,
    RankWhere,
)
from notebook_launcher.launcher.metric_batch import MetricBatch
from notebook_launcher.launcher.plan import LaunchPlan
from notebook_launcher.launcher.rank import RankSpec, run_rank
from notebook_launcher.launcher.rank_handle import Rank, RankState

__all__ = ["Outcome", "Rank", "RankGroup", "RankState", "crash_excerpt"]

_READ_CHUNK = 1 << 16
_STOP_EXITCODES = (-signal.SIGTERM, -signal.SIGKILL)  # a rank ended by the group's stop
STOP_GRACE_S = 3.0  # SIGTERM -> SIGKILL
# After a rank exits, what it started may still hold its pipes open this long.
DRAIN_GRACE_S = 1.0
_REAP_WAIT_S = 1.0


@dataclasses.dataclass
class Outcome:
    """What a run of the group came to; failures are data, the root cause decided later."""

    results: dict[int, Result] = dataclasses.field(default_factory=dict)
    failures: list[RankFailure] = dataclasses.field(default_factory=list)
    remote_exceptions: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    remote_types: dict[int, type[BaseException]] = dataclasses.field(default_factory=dict)
    finished_at: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> time.time()
    timed_out_ranks: list[int] = dataclasses.field(default_factory=list)
    stopped_from_outside: bool = False
    # Where each rank still running was when the group ended it from outside (a timeout, a
    # stop): rank -> "was in cell 5, line 3 (in train), in all_reduce ..." (see whereabouts).
    where: dict[int, str] = dataclasses.field(default_factory=dict)


MessageHandler = Callable[[Rank, Any], None]


class RankGroup:
    def __init__(
        self,
        plan: LaunchPlan,
        backend: Backend,
        specs: Sequence[RankSpec],
        emit: Callable[[LaunchEvent], None],
        *,
        launch_id: str,
        with_commands: bool = False,
        stop_on_failure: bool = True,
        grace_s: float = STOP_GRACE_S,
        kill_wait_s: float = descendants.KILL_WAIT_S,
    ) -> None:
        self.plan = plan
        self.backend = backend
        self.launch_id = launch_id
        self._specs = list(specs)
        self._emit = emit
        self._with_commands = with_commands
        self._stop_on_failure = stop_on_failure
        self._grace_s = grace_s
        self._kill_wait_s = kill_wait_s
        self.ranks: list[Rank] = []
        self.outcome = Outcome()
        self._selector: selectors.BaseSelector | None = None
        self._deadline: float | None = None
        self._stop_requested: Callable[[], bool] = lambda: False
        self._on_message: MessageHandler | None = None
        self._kill_at: float | None = None
        self._closed = False
        self._term_deadline: float | None = None
        self._kill_deadline: float | None = None
        self._started: Started | None = None  # what the backend started for this group
        self._memory_watch = memory_deaths.GroupWatch()
        # When the group began ending its ranks for timeout= or a stop from the sidebar
        # (time.time(), the clock of a rank's failure): what fails from then on is the stop's
        # doing, a peer ended first cutting a collective short.
        self._ended_from_outside_at: float | None = None
        self._asker = whereabouts.Asker()  # where the ranks were when ended from outside

    # start ----------------------------------------------------------------------------

    def start(self, payload: Any, target: RankTarget = run_rank) -> None:
        """Start every rank; on failure nothing started is left running (close() still frees)."""
        self._selector = selectors.DefaultSelector()
        for spec in self._specs:
            self.ranks.append(Rank(spec, self._with_commands))
        self._started = start_ranks(
            self.backend, self.plan, self._specs, [r.ends for r in self.ranks], payload, target
        )
        for rank, control in zip(self.ranks, self._started.controls):
            rank.started(control)
            for fd in rank.streams:
                self._selector.register(fd, selectors.EVENT_READ, (rank, "stream"))
            self._selector.register(rank.channel.fileno(), selectors.EVENT_READ, (rank, "channel"))
            if control.sentinel is not None:
                self._selector.register(control.sentinel, selectors.EVENT_READ, (rank, "exit"))
        for rank in self.ranks:
            self._emit(RankStarted(rank.rank, rank.pid, self.plan.device(rank.spec.local_rank)))

    # run ------------------------------------------------------------------------------

    def run(
        self,
        *,
        deadline: float | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        until: Callable[[], bool] | None = None,
        on_message: MessageHandler | None = None,
    ) -> Outcome:
        """Multiplex until every rank ended (and its output was read), or ``until()`` holds.

        ``deadline`` (time.monotonic()) ends a run that takes longer, stopping every rank;
        ``stop_requested`` is polled each ``plan.monitor_interval``. The first failure stops
        the other ranks (with ``stop_on_failure``). Messages of kinds the group does not
        know go to ``on_message``.
        """
        self._deadline, self._stop_requested, self._on_message = (
            deadline,
            stop_requested,
            on_message,
        )
        while (until is None or not until()) and self._busy():
            self.watch(self._next_timeout())
        return self.outcome

    def watch(self, timeout: float = 0.0, limits: bool = True) -> None:
        """One pass of the multiplexer: read what is there, notice ends, apply limits."""
        assert self._selector is not None, "start() first"
        for key, _ in self._selector.select(timeout):
            rank, kind = key.data
            # A key may be stale: handling an exit earlier in this batch drains it.
            if kind == "stream":
                if key.fd in rank.streams:
                    self._read_stream(rank, key.fd)
            elif kind == "channel":
                if not rank.channel.closed:
                    self._read_channel(rank)
            elif rank.control is not None:
                self._unregister(rank.control.sentinel)
                if not rank.alive:
                    continue
                # The sentinel closes as the process exits, a moment before it can be reaped.
                ended = rank.control.wait(_REAP_WAIT_S)
                if ended is not None:
                    self._on_end(rank, ended)
        # Every pass also polls: ranks without a sentinel, a sentinel that closed a moment
        # before the exit could be reaped, and one held open by something the rank forked.
        for rank in self.ranks:
            if rank.alive and rank.control is not None:
                ended = rank.control.poll()
                if ended is not None:
                    self._on_end(rank, ended)
        if limits:
            self._check_limits()

    def flush_partial_lines(self) -> None:
        """Read what the ranks wrote so far, then emit their unfinished lines as lines.

        For a session, whose ranks flush their streams before answering a command: the
        output of one cell, partial last line included, belongs to that cell.
        """
        for rank in self.ranks:
            for fd in list(rank.streams):
                self._read_stream(rank, fd)
            for stream, splitter in rank.splitters.items():
                for text, is_progress in splitter.flush():
                    rank.tail.append(text)
                    self._emit(OutputLine(rank.rank, stream, text, is_progress))

    def signal_rank(self, rank: int, signum: int) -> None:
        """Send ``signum`` to the process of rank ``rank`` alone, not to what it started
        (see :meth:`RankControl.signal_rank`); a no-op once it is gone."""
        control = self.ranks[rank].control
        if control is not None and self.ranks[rank].ended is None:
            control.signal_rank(signum)

    def send(self, rank: int, message: Any) -> None:
        """Send a command to one rank (a group started ``with_commands``)."""
        connection = self.ranks[rank].commands
        if connection is None:
            raise LaunchError(
                f"cannot send a command to rank {rank}: its group was started without command "
                "connections; start it with with_commands=True."
            )
        connection.send(message)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask every running rank to end; SIGKILL follows after the grace period."""
        self._say_where()
        if self._ended_from_outside_at is None and (
            self.outcome.timed_out_ranks or self.outcome.stopped_from_outside
        ):
            self._ended_from_outside_at = time.time()
        for rank in self.ranks:
            rank.request_stop(signum)
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self._grace_s

    def _busy(self) -> bool:
        if any(rank.alive for rank in self.ranks):
            return True
        assert self._selector is not None
        last_end = max((r.ended_at or 0.0) for r in self.ranks) if self.ranks else 0.0
        if self._selector.get_map() and time.time() - last_end < DRAIN_GRACE_S:
            return True
        for rank in self.ranks:  # whatever still holds a pipe is stopped; take what it wrote
            if rank.control is not None:
                rank.control.signal(signal.SIGKILL)
            for fd in list(rank.streams):
                self._read_stream(rank, fd, until_eof=True)
        return False

    def _next_timeout(self) -> float:
        timeout = self.plan.monitor_interval
        now = time.monotonic()
        for moment in (self._deadline, self._kill_at, self._asker.deadline):
            if moment is not None:
                timeout = min(timeout, max(0.0, moment - now))
        return timeout

    def _unregister(self, fd: int | None) -> None:
        if fd is not None and self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fd)

    def _read_stream(self, rank: Rank, fd: int, until_eof: bool = False) -> None:
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
                self._unregister(fd)
                rank.close_stream(fd)
            else:
                pieces = rank.splitters[stream].feed(data)
            for text, is_progress in pieces:
                if not is_progress:
                    rank.tail.append(text)
                self._emit(OutputLine(rank.rank, stream, text, is_progress))
            if not data or len(data) < _READ_CHUNK:
                return

    def _read_channel(self, rank: Rank) -> None:
        try:
            message = rank.channel.recv()
        except (EOFError, OSError):
            self._unregister(rank.channel.fileno())
            rank.channel.close()
            return
        except Exception as error:  # garbled: nothing after it can be read either
            self._unregister(rank.channel.fileno())
            rank.channel.close()
            text = (
                f"notebook_launcher: the messages of rank {rank.rank} to the notebook could not be "
                f"read ({type(error).__name__}: {error}); its result cannot arrive. Something "
                "else in the rank wrote to its message pipe."
            )
            rank.tail.append(text)
            self._emit(OutputLine(rank.rank, "stderr", text, False))
            return
        if isinstance(message, Hello):
            if rank.control is not None:
                rank.control.pid_reported(message.pid)
            rank.hello_at = time.monotonic()
            rank.memory_watch = self._memory_watch.watch(message.pid)
        elif isinstance(message, (Result, Failure)):
            rank.messages.append(message)
        elif isinstance(message, Progress):
            self._emit(RankProgress(rank.rank, message.n, message.total, message.description))
        elif isinstance(message, MetricBatch):
            self._emit(RankMetrics(rank.rank, message))
        elif isinstance(message, Memory):
            rank.last_rss = message.rss_bytes
            self._emit(
                RankMemory(
                    rank.rank,
                    message.kind,
                    message.peak_bytes,
                    message.current_bytes,
                    message.device,
                    message.rss_bytes,
                )
            )
        elif isinstance(message, Steps):
            self._emit(RankSteps(rank.rank, message.summary))
        elif isinstance(message, Whereabouts):
            self._asker.answered(rank.rank, message)
        elif self._on_message is not None:
            self._on_message(rank, message)

    def _on_end(self, rank: Rank, ended: Ended) -> None:
        rank.mark_ended(ended)
        if rank.control is not None:  # found by polling: its sentinel must not keep the loop busy
            self._unregister(rank.control.sentinel)
        # The rank wrote its last message before exiting: take it before judging the exit.
        while not rank.channel.closed and rank.channel.poll():
            self._read_channel(rank)
        failure = self._judge(rank)
        if failure is not None:
            self.outcome.failures.append(failure)
            if self._stop_on_failure and self._kill_at is None:
                self.stop()
        self._finished(rank, failure)

    def _finished(self, rank: Rank, failure: RankFailure | None) -> None:
        if rank.finished_sent:
            return
        rank.finished_sent = True
        self.outcome.finished_at[rank.rank] = rank.ended_at or time.time()
        exitcode = rank.ended.exitcode if rank.ended is not None else None
        state = (
            "failed"
            if failure is not None
            else "done"
            if rank.rank in self.outcome.results
            else "stopped"
        )
        self._emit(RankFinished(rank.rank, exitcode, failure, state))

    def _judge(self, rank: Rank) -> RankFailure | None:
        exitcode = rank.ended.exitcode if rank.ended is not None else None
        for message in rank.messages:
            if isinstance(message, Failure):
                if (
                    self._ended_from_outside_at is not None
                    and message.time >= self._ended_from_outside_at
                ):
                    return None  # stopped, as its peers were: the launch says why it ended
                self._keep_remote_exception(rank.rank, message.exception, message.exception_class)
                return RankFailure(
                    rank.rank,
                    rank.pid,
                    exitcode,
                    message.exception_type,
                    message.message,
                    message.traceback,
                    time=message.time,
                )
            # A rank stopped by the group after its result was sent had returned: the
            # signal only cut short its process's exit.
            if isinstance(message, Result) and (
                exitcode in (0, None) or (rank.stop_sent and exitcode in _STOP_EXITCODES)
            ):
                self.outcome.results[rank.rank] = message
                return None
        lost = rank.ended.lost if rank.ended is not None else None
        if rank.stop_sent and not lost:
            return None  # ended because the group stopped it
        # A rank lost with its machine is a failure even while the group was stopping it:
        # the stop did not end it, and its loss often explains why its peers failed.
        out_of_memory = None
        if exitcode == -signal.SIGKILL and not lost:
            out_of_memory = memory_deaths.oom_reason(
                rank.memory_watch, rank.pid, rank.last_rss, rank.hello_at
            )
        return RankFailure(
            rank.rank,
            rank.pid,
            exitcode,
            output_tail=crash_excerpt(list(rank.tail)),
            time=time.time(),
            lost=lost or "",
            out_of_memory=out_of_memory or "",
        )

    def _keep_remote_exception(
        self, rank: int, pickled: bytes | None, pickled_class: bytes | None
    ) -> None:
        for data, where in (
            (pickled, self.outcome.remote_exceptions),
            (pickled_class, self.outcome.remote_types),
        ):
            if data is not None:
                with contextlib.suppress(Exception):  # its class may not exist in the kernel
                    where[rank] = cloudpickle.loads(data)

    def _check_limits(self) -> None:
        now = time.monotonic()
        if self._kill_at is not None:
            if now >= self._kill_at:
                for rank in self.ranks:
                    rank.request_stop(signal.SIGKILL)
            return
        if self._asker.asking:  # ended from outside: the ranks are told to end once they said
            if not self._asker.waiting_for({r.rank for r in self.ranks if r.alive}):
                self.stop()
        elif self._deadline is not None and now >= self._deadline:
            self.outcome.timed_out_ranks = [r.rank for r in self.ranks if r.alive]
            if not self._ask_where():
                self.stop()
        elif self._stop_requested():
            self.outcome.stopped_from_outside = True
            if not self._ask_where():
                self.stop()

    def _ask_where(self) -> bool:
        """Ask every rank still running where it is, before ending it (see whereabouts);
        whether there is an answer to wait for."""
        askable = {r.rank: r.asks for r in self.ranks if r.alive and not r.stop_sent}
        if any(fd is not None for fd in askable.values()) and not self._asker.asking:
            self._asker.ask(askable)
        return self._asker.waiting_for(set(askable))

    def _say_where(self) -> None:
        """Keep and tell what the asked ranks said, once, before they are ended."""
        if self._asker.asking and not self.outcome.where:
            self.outcome.where = self._asker.lines()
            for rank, text in sorted(self.outcome.where.items()):
                with contextlib.suppress(Exception):  # an observer's bug must not stop the stop
                    self._emit(RankWhere(rank, text))

    # close ----------------------------------------------------------------------------

    def close(self) -> list[Rank]:
        """End every rank and free everything, each step time-limited; idempotent.

        SIGTERM, wait (one shared grace period), SIGKILL, wait at most ``kill_wait_s``,
        then end what the ranks started, even what left their process groups. A rank
        that still would not die (stuck in the OS kernel) is reported with a
        LaunchCleanupWarning and returned, never waited for. An interrupt while closing
        skips the grace period but not the cleanup, then is raised again.
        """
        interrupt: KeyboardInterrupt | None = None
        while True:
            try:
                self._teardown(hurry=interrupt is not None)
                break
            except KeyboardInterrupt as again:
                interrupt = again
        if interrupt is not None:
            raise interrupt
        return [r for r in self.ranks if r.control is not None and r.ended is None]

    def _teardown(self, hurry: bool) -> None:
        if self._closed:
            return
        if not hurry and self._term_deadline is None and self._selector is not None:
            # Ended by an interrupt (the stop button): the ranks say where they were first.
            with contextlib.suppress(Exception):  # an observer's bug must not stop cleanup
                self._ask_where()
                while self._asker.waiting_for({r.rank for r in self.ranks if r.alive}):
                    self.watch(max(0.0, (self._asker.deadline or 0.0) - time.monotonic()), False)
        self._say_where()
        if not hurry:
            if self._term_deadline is None:
                self._term_deadline = time.monotonic() + self._grace_s
                for rank in self.ranks:
                    rank.request_stop(signal.SIGTERM)
            self._wait_all(self._term_deadline)
        if self._kill_deadline is None:
            self._kill_deadline = time.monotonic() + self._kill_wait_s
        for rank in self.ranks:
            if rank.ended is None:
                rank.request_stop(signal.SIGKILL)
        self._wait_all(self._kill_deadline)
        for rank in self.ranks:  # what the ranks started, left in their process groups
            if rank.control is not None:
                rank.control.signal(signal.SIGKILL)
        # And what left those groups. A rank that returned ended its own descendants as it
        # exited (it is their subreaper); one that was stopped or crashed could not. They
        # are gone when the launch returns (unless stop was pressed again: then it returns at
        # once); the ranks themselves had their wait above.
        if any(r.control is not None and r.rank not in self.outcome.results for r in self.ranks):
            ranks = {r.pid for r in self.ranks if r.pid is not None}
            wait_s = 0.0 if hurry else self._kill_wait_s
            descendants.end_marked_processes(self.launch_id, wait_s=wait_s, spare=ranks)
        for rank in self.ranks:
            if rank.ended is not None and not rank.finished_sent:
                with contextlib.suppress(Exception):  # an observer's bug must not stop cleanup
                    self._finished(rank, None)
            rank.release()
        if self._selector is not None:
            self._selector.close()
        if self._started is not None:
            self._started.close()
        else:  # the start raised: a backend that returns a list frees what it held here
            self.backend.close()
        self._closed = True
        stuck = [r for r in self.ranks if r.control is not None and r.ended is None]
        if stuck:
            names = ", ".join(f"rank {r.rank} (pid {r.pid})" for r in stuck)
            warnings.warn(
                f"{names} did not end within {self._kill_wait_s:g}s of SIGKILL, probably stuck "
                "in the operating system (a hung device driver or network file system); it "
                "was left running. Check it with `ps -o pid,stat,wchan -p PID`; if it stays, "
                "only a restart of the machine ends it.",
                LaunchCleanupWarning,
                stacklevel=4,
            )

    def _wait_all(self, deadline: float) -> None:
        for rank in self.ranks:
            if rank.control is None or rank.ended is not None:
                continue
            ended = rank.control.wait(max(0.0, deadline - time.monotonic()))
            if ended is not None:
                rank.mark_ended(ended)


def crash_excerpt(lines: list[str], keep: int = 20) -> str:
    """The part of a crashed rank's last output worth showing: faulthandler's report
    (innermost frames first) when there is one, else the last lines."""
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return "\n".join(lines[index : index + keep])
    return "\n".join(lines[-keep:])
