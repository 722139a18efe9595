"""A session's ranks seen from the kernel: started with the launcher's rank machinery,
then driven command by command.

The ranks are the launcher's own (:class:`RankProcess` running ``run_rank``, with the
launcher's environment contract, fd-level output pipes and message channel); the rank
function is the session's serve loop, which also gets a command pipe. One selector over
every rank's output, channel and exit sentinel is pumped from the calling thread only
while the kernel waits for an answer, so output lands in the cell that asked.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
import uuid
from typing import Any, Callable

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.channel import Failure, Metric, Progress
from notebook_launcher.launcher.events import (
    LaunchObserver,
    OutputLine,
    RankMetric,
    RankProgress,
)
from notebook_launcher.launcher.monitor import crash_excerpt
from notebook_launcher.launcher.options import LaunchPlan
from notebook_launcher.launcher.processes import RankProcess, close_all
from notebook_launcher.launcher.run import _rank_specs, start_context
from notebook_launcher.launcher.store import RendezvousStore, bind_listener
from notebook_launcher.session.protocol import Command, Ready, Reply
from notebook_launcher.session.worker import serve

_READ_CHUNK = 1 << 16
STOP_GRACE_S = 3.0


class SessionRanks:
    """Started ranks plus what it takes to talk to them; :meth:`close` frees all of it."""

    def __init__(self, plan: LaunchPlan, observers: list[LaunchObserver]) -> None:
        self.plan = plan
        self.launch_id = uuid.uuid4().hex[:12]
        self._observers = observers
        self.ranks: list[RankProcess] = []
        self.commands: list[Any] = []  # kernel ends of the command pipes, by rank
        self.replies: dict[tuple[int, int], Reply] = {}  # (rank, seq) -> reply
        self.ready: dict[int, Ready] = {}
        self.exited: dict[int, RankFailure | None] = {}  # rank -> how it ended (None: asked to)
        self._selector: selectors.BaseSelector | None = None
        self._store: RendezvousStore | None = None
        self._closed = False
        listener = bind_listener(plan.master_addr, plan.port)
        try:
            self._store = RendezvousStore(listener, plan.num_processes)
        except BaseException:
            listener.close()
            raise
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        fork = self.plan.start.method == "fork"
        context = start_context(self.plan.start.method)
        self._selector = selectors.DefaultSelector()
        assert self._store is not None
        for spec in _rank_specs(self.plan, self.launch_id, self._store.port, fork):
            reader, writer = context.Pipe(duplex=False)
            self.commands.append(writer)
            try:
                # The serve loop goes by reference (it is importable), the pipe end
                # through multiprocessing's own handing-over of connections.
                rank = RankProcess(context, spec, (serve, (reader,), {}))
            finally:
                reader.close()
            self.ranks.append(rank)
            for fd in rank.streams:
                self._selector.register(fd, selectors.EVENT_READ, (rank, "stream"))
            self._selector.register(rank.channel.fileno(), selectors.EVENT_READ, (rank, "channel"))
            self._selector.register(rank.process.sentinel, selectors.EVENT_READ, (rank, "exit"))

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self.ranks]

    def send(self, rank: int, command: Command) -> None:
        try:
            self.commands[rank].send(command)
        except (BrokenPipeError, OSError):
            self.poll_exits()  # the rank is gone; its exit says how

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to the ranks themselves (not their children, which are not running a cell)."""
        for index in ranks:
            rank = self.ranks[index]
            if rank.running and rank.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signal.SIGINT)

    def poll_exits(self) -> list[int]:
        """Ranks found dead now (without waiting); each is recorded in ``exited``."""
        found = []
        for rank in self.ranks:
            if rank.running and rank.process.exitcode is not None:
                self._on_exit(rank)
                found.append(rank.rank)
        return found

    def pump(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Handle output, messages and exits until ``done()`` or a rank exits or ``timeout``."""
        assert self._selector is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        exits_before = len(self.exited)
        while not done() and len(self.exited) == exits_before:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            for key, _ in self._selector.select(remaining):
                self._handle(key)

    def drain(self) -> None:
        """Show what the ranks wrote before their replies (already in the pipes)."""
        assert self._selector is not None
        while True:
            ready = [key for key, _ in self._selector.select(0) if key.data[1] != "exit"]
            if not ready:
                return
            for key in ready:
                self._handle(key)

    def _handle(self, key: selectors.SelectorKey) -> None:
        rank, kind = key.data
        if kind == "stream":
            if key.fd in rank.streams:
                self._read_stream(rank, key.fd)
        elif kind == "channel":
            if not rank.channel.closed:
                self._read_channel(rank)
        elif rank.running:
            self._on_exit(rank)

    def _read_stream(self, rank: RankProcess, fd: int, until_eof: bool = False) -> None:
        assert self._selector is not None
        stream = rank.streams[fd]
        while True:
            try:
                data = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                if not until_eof:
                    return
                data = b""
            if not data:
                pieces = rank.splitters[stream].close()
                self._selector.unregister(fd)
                rank.close_stream(fd)
            else:
                pieces = rank.splitters[stream].feed(data)
            for text, is_progress in pieces:
                if not is_progress:
                    rank.tail.append(text)
                self._emit(OutputLine(rank.rank, stream, text, is_progress))
            if not data or len(data) < _READ_CHUNK:
                return

    def _read_channel(self, rank: RankProcess) -> None:
        assert self._selector is not None
        try:
            message = rank.channel.recv()
        except (EOFError, OSError):
            self._selector.unregister(rank.channel.fileno())
            rank.channel.close()
            return
        if isinstance(message, Reply):
            self.replies[(rank.rank, message.seq)] = message
        elif isinstance(message, Ready):
            self.ready[rank.rank] = message
        elif isinstance(message, Failure):
            rank.messages.append(message)  # the serve loop itself failed (set-up)
        elif isinstance(message, Progress):
            self._emit(RankProgress(rank.rank, message.n, message.total, message.description))
        elif isinstance(message, Metric):
            self._emit(RankMetric(rank.rank, message.values, message.step))

    def _on_exit(self, rank: RankProcess) -> None:
        assert self._selector is not None
        with contextlib.suppress(KeyError):
            self._selector.unregister(rank.process.sentinel)
        rank.process.join()
        rank.exited_at = time.monotonic()
        while not rank.channel.closed and rank.channel.poll():
            self._read_channel(rank)
        for fd in list(rank.streams):  # its last words, up to what it wrote before dying
            self._read_stream(rank, fd, until_eof=True)
        self.exited[rank.rank] = None if rank.stop_sent else self._failure(rank)

    def _failure(self, rank: RankProcess) -> RankFailure:
        for message in rank.messages:
            if isinstance(message, Failure):
                return RankFailure(
                    rank.rank, rank.pid, rank.exitcode, message.exception_type, message.message,
                    message.traceback, time=message.time,
                )
        return RankFailure(
            rank.rank, rank.pid, rank.exitcode, output_tail=crash_excerpt(list(rank.tail)),
            time=time.time(),
        )

    def _emit(self, event: Any) -> None:
        for observer in self._observers:
            observer.on_event(event)

    def close(self) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after a shared grace) and free everything."""
        if self._closed:
            return
        self._closed = True
        try:
            close_all(self.ranks, STOP_GRACE_S)
        finally:
            for writer in self.commands:
                writer.close()
            if self._selector is not None:
                self._selector.close()
            self._store = None  # the store frees its port when released
