"""Structured messages a rank sends to the launching kernel, and the rank's sending end.

Output travels separately, through the rank's stdout and stderr pipes, so that what
C/C++ code writes is caught too. This channel carries what has structure: the result,
a failure, and the live kinds a dashboard reads (progress, and metrics as a
``MetricBatch``). A new kind is a new dataclass here plus its handling in the rank group
(or a handler passed to it, as sessions do); kinds nobody handles are ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any, Union

import cloudpickle

from notebook_launcher.launcher.metric_batch import MetricBatch
from notebook_launcher.stack_location import Location

# Log calls leave in batches, at most this often, sent by a thread of their own: the
# logging thread only appends. A pipe write wakes the kernel's reading thread, which on a
# virtual machine can hold the writer for hundreds of microseconds; a training loop logging
# every millisecond would pay that a thousand times a second. A call after a quiet spell
# leaves at once.
METRICS_WAIT_S = 0.02
METRICS_PER_MESSAGE = 16384  # past this many waiting calls, the logging thread sends them


@dataclasses.dataclass(frozen=True)
class Hello:
    """The first message of every rank: its pid, which some backends learn only so."""

    pid: int


@dataclasses.dataclass(frozen=True)
class Result:
    payload: bytes  # the return value, cloudpickled
    exit_code: int | str | None = None  # set when the function ended with sys.exit(0 / None)

    def value(self) -> Any:
        return cloudpickle.loads(self.payload)


@dataclasses.dataclass(frozen=True)
class Failure:
    exception_type: str  # qualified name, for the message
    message: str
    traceback: str
    time: float
    exception: bytes | None  # the exception itself, cloudpickled, when that worked
    exception_class: bytes | None = None  # its type alone, for when the instance cannot travel


@dataclasses.dataclass(frozen=True)
class Progress:
    n: int
    total: int | None
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Memory:
    """The rank's memory: its peak so far and what it holds now, in bytes."""

    kind: str  # "rss" or "cuda" (see ``notebook_launcher.rank_memory``)
    peak_bytes: int
    current_bytes: int
    device: str
    rss_bytes: int | None = None  # resident memory now, also on a GPU rank


@dataclasses.dataclass(frozen=True)
class Steps:
    """The rank's step anatomy so far (medians per step; see ``accelerator.step_timing``)."""

    summary: dict[str, Any]  # count, median_s, compute_s, collectives_s (None: not timed), data_s


@dataclasses.dataclass(frozen=True)
class Whereabouts:
    """Where the rank was when the kernel asked (see ``launcher.whereabouts``)."""

    phase: str  # "starting" (its function had not begun), "running", or "returned"
    location: Location | None  # None: the thread running the function ran no Python code


RankMessage = Union[Hello, Result, Failure, Progress, MetricBatch, Memory, Steps, Whereabouts]


class Outbox:
    """A rank's end of the channel: messages leave in the order they were given.

    Log calls are batched (see ``METRICS_WAIT_S``); any other message first sends the
    calls still waiting, so a result never overtakes the metrics logged before it. Safe to
    use from several threads of the rank.

    A process the rank forks (a data loader worker) inherits the outbox but sends nothing:
    its writes would land in the middle of the rank's own, garbling both. What it logs is
    dropped, and it says so once on its stderr.
    """

    def __init__(self, channel: Connection) -> None:
        self._channel = channel
        self._owner = os.getpid()
        self._last_sent = -METRICS_WAIT_S
        self._start_empty()
        _outboxes.add(self)

    def _start_empty(self) -> None:
        self._ready = threading.Condition()  # guards the waiting calls
        # Held while taking waiting calls and writing them: whoever takes first, writes first.
        # Always taken before _ready, never while holding it.
        self._writing = threading.Lock()
        self._steps: list[float | None] = []
        self._values: list[dict[str, float]] = []
        self._sender: threading.Thread | None = None
        self._sender_idle = False  # waiting for a first call, without a deadline
        self._told_forked = False  # this process said it is not the rank's

    def send(self, message: RankMessage) -> None:
        if self._owned():
            self._write_waiting(message)

    def flush(self) -> None:
        """Sends the calls waiting now, before returning."""
        if self._owned():
            self._write_waiting(None)

    def log(self, step: float | None, values: dict[str, float]) -> None:
        if not self._owned():
            return
        with self._ready:
            self._steps.append(step)
            self._values.append(values)
            waiting = len(self._steps)
            if waiting == 1:
                self._wake_sender()
        if waiting >= METRICS_PER_MESSAGE:
            with contextlib.suppress(OSError, ValueError):  # the kernel's end is gone
                self._write_waiting(None)

    def _owned(self) -> bool:
        if self._owner == os.getpid():
            return True
        if not self._told_forked:
            self._told_forked = True
            with contextlib.suppress(OSError, ValueError):
                print(
                    f"notebook_launcher: what process {os.getpid()} logs or reports is not sent to "
                    f"the notebook: it was forked by rank process {self._owner} (a data loader "
                    "worker, say). Only the rank's own process reports metrics and progress.",
                    file=sys.stderr,
                    flush=True,
                )
        return False

    def _wake_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_waiting, name="notebook-launcher-metrics", daemon=True
            )
            self._sender.start()
        elif self._sender_idle:
            self._ready.notify()

    def _write_waiting(self, message: RankMessage | None) -> None:
        """Writes the calls waiting, as one batch, then ``message``."""
        # Locks by ``with`` alone: an interrupt (a session's stop) never leaves one held.
        with self._writing:
            with self._ready:
                steps, values = self._steps, self._values
                if steps:
                    self._steps, self._values = [], []
                    self._last_sent = time.monotonic()
            if steps:
                self._channel.send(MetricBatch.of_calls(steps, values))
            if message is not None:
                self._channel.send(message)

    def _send_waiting(self) -> None:
        """The sender thread: waiting calls leave METRICS_WAIT_S after the last batch."""
        while True:
            with self._ready:
                while True:
                    if not self._steps:
                        self._sender_idle = True
                        self._ready.wait()
                        self._sender_idle = False
                    elif (left := self._last_sent + METRICS_WAIT_S - time.monotonic()) > 0:
                        self._ready.wait(left)  # not woken meanwhile: later calls join the batch
                    else:
                        break
            try:
                self._write_waiting(None)
            except (OSError, ValueError):  # the kernel's end is gone: nobody to tell
                return


_outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A process the rank forks (a data loader worker) has no sender thread, and its copy
    # of the lock may be held by one; the calls waiting are the parent's to send.
    for outbox in list(_outboxes):
        outbox._start_empty()


os.register_at_fork(after_in_child=_after_fork_in_child)
