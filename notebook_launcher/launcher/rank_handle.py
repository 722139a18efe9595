"""One rank as the kernel sees it: its lifecycle state, its pipes, what it reported.

Owned by the rank group (``rank_group.RankGroup``), which moves each rank through its states.
"""

from __future__ import annotations

import collections
import enum
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from notebook_launcher.launcher import memory_deaths
from notebook_launcher.launcher.backends.base import Ended, RankControl, RankEnds
from notebook_launcher.launcher.lines import LineSplitter
from notebook_launcher.launcher.rank import RankSpec

_TAIL_LINES = 200  # enough to hold a crash report of a deep stack


class RankState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"  # the group asked it to end; its end is not a failure
    EXITED = "exited"


class Rank:
    """One rank as the kernel sees it: its state, its pipes, and what it reported."""

    def __init__(self, spec: RankSpec, with_commands: bool) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.state = RankState.STARTING
        self.control: RankControl | None = None
        self.streams: dict[int, str] = {}  # read fd -> "stdout" / "stderr"
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.messages: list[Any] = []  # Result / Failure, judged when it ends
        self.ended: Ended | None = None
        self.ended_at: float | None = None  # time.time() of its end
        self.finished_sent = False
        self.stop_sent = False
        self.commands: Connection | None = None
        self.asks: int | None = None  # the kernel's end of the pipe that asks where it is
        # For naming a death by the OOM killer: the rank's memory cgroups with their kill
        # counters when it said hello, and its resident memory last reported.
        self.memory_watch: list[memory_deaths.CgroupWatch] = []
        self.hello_at = time.monotonic()
        self.last_rss: int | None = None
        made: list[Connection] = []  # closed again if making the next one fails
        readers: list[int] = []  # read with os.read, closed by close_stream
        try:
            for _stream in ("stdout", "stderr"):
                read_end, write_end = os.pipe()
                readers.append(read_end)
                made.append(Connection(write_end, readable=False))
                os.set_blocking(read_end, False)
            self.channel, channel_w = multiprocessing.Pipe(duplex=False)
            made += [self.channel, channel_w]
            commands_r = asks_r = None
            if with_commands:
                commands_r, self.commands = multiprocessing.Pipe(duplex=False)
            else:  # a session's ranks are asked by their own signal watch
                asks_fd, self.asks = os.pipe()
                asks_r = Connection(asks_fd, writable=False)
                made.append(asks_r)
                os.set_blocking(self.asks, False)
        except BaseException:
            for connection in made:
                connection.close()
            for fd in readers + ([self.asks] if self.asks is not None else []):
                os.close(fd)
            raise
        self.streams = dict(zip(readers, ("stdout", "stderr")))
        self.ends = RankEnds(made[0], made[1], channel_w, commands_r, asks_r)

    @property
    def pid(self) -> int | None:
        return self.control.pid if self.control is not None else None

    @property
    def alive(self) -> bool:
        return self.state in (RankState.RUNNING, RankState.STOPPING)

    def started(self, control: RankControl) -> None:
        self.control = control
        self.state = RankState.RUNNING
        self.ends.close()  # the rank holds its own copies now

    def request_stop(self, signum: int) -> None:
        if self.alive and self.control is not None:
            self.stop_sent = True
            self.state = RankState.STOPPING
            self.control.signal(signum)

    def mark_ended(self, ended: Ended) -> None:
        self.ended = ended
        self.ended_at = time.time()
        self.state = RankState.EXITED

    def close_stream(self, fd: int) -> None:
        if self.streams.pop(fd, None) is not None:
            os.close(fd)

    def release(self) -> None:
        """Free every descriptor the kernel holds for this rank (idempotent)."""
        self.ends.close()
        for fd in list(self.streams):
            self.close_stream(fd)
        for connection in (self.channel, self.commands):
            if connection is not None and not connection.closed:
                connection.close()
        if self.asks is not None:
            os.close(self.asks)
            self.asks = None
        if self.control is not None and self.ended is not None:
            self.control.release()
