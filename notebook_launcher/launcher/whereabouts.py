"""Where each rank was when its launch was ended from outside: by ``timeout=``, the stop
button, or a stop from the sidebar.

Before the ranks are ended, the kernel asks each rank still running with one byte on a
pipe of its own; a side thread of the rank, blocked reading that pipe until then (it costs
the rank nothing while nobody asks), answers with where the rank's main thread is
(``stack_location``), through the rank's message channel. It answers while the main thread
waits inside a C++ collective or sleeps, since those let go of Python's lock; a rank stuck
in C code that holds the lock cannot answer, and is said not to have. No signal is used: a
cell may install its own handler for any of them, or block them.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import time
from typing import Callable

from notebook_launcher import cell_names
from notebook_launcher.launcher.channel import Whereabouts
from notebook_launcher.launcher.signal_wake import RETRY_S, SignalWake
from notebook_launcher.stack_location import (
    describe,
    locate,
    main_thread_frame,
    outside_libraries,
)

# The kernel waits at most this long for the answers: a safety net for a rank that cannot
# answer; answering ranks take milliseconds, and the wait ends with the last answer.
ANSWER_WAIT_S = 2.0
NO_ANSWER = "did not say where it was"


# The rank's side ---------------------------------------------------------------------


class Answerer:
    """In a launched rank: the side thread that says where the thread running the function
    is, wakes that thread for its signal handlers (``signal_wake``), and does one more duty
    every ``every[0]`` seconds (the rank's memory readings).

    One side thread for all three: each thread a rank starts takes Python's lock from the
    function's thread for a moment, and on a busy machine that moment waits for the
    scheduler to run it (milliseconds a thread in a short launch).
    """

    def __init__(
        self,
        asks_fd: int,
        send: Callable[[Whereabouts], None],
        wake: SignalWake | None,
        every: tuple[float, Callable[[], None]] | None = None,
    ) -> None:
        self.phase = "starting"
        self._thread = _thread.get_ident()  # the thread that runs the function
        self._send = send
        self._wake = wake
        self._every = every
        # Nothing waits for the thread to start (on a busy machine that costs milliseconds).
        _thread.start_new_thread(self._serve, (asks_fd,))

    def _serve(self, asks_fd: int) -> None:
        wake = self._wake
        # poll, not select: a kernel holding a thousand descriptors gives its ranks' pipes
        # numbers that select() refuses.
        watched = select.poll()
        watching = {asks_fd} if wake is None else {asks_fd, wake.fd}
        for fd in watching:
            watched.register(fd, select.POLLIN)
        interval, duty = self._every or (0.0, None)
        duty_at = time.monotonic() + interval if duty is not None else None
        while watching or duty_at is not None:
            waiting = wake is not None and wake.waiting
            timeout = RETRY_S if waiting else None
            if duty_at is not None:
                until_duty = max(0.0, duty_at - time.monotonic())
                timeout = until_duty if timeout is None else min(timeout, until_duty)
            try:
                events = watched.poll(None if timeout is None else timeout * 1000)
            except OSError:
                return
            readable = set()
            for fd, event in events:
                if event & select.POLLNVAL:  # closed by the function: never readable again
                    watched.unregister(fd)
                    watching.discard(fd)
                else:
                    readable.add(fd)
            if duty is not None and duty_at is not None and time.monotonic() >= duty_at:
                with contextlib.suppress(Exception):  # a duty must never end the thread
                    duty()
                duty_at = time.monotonic() + interval
            if wake is not None:
                if wake.fd in readable:
                    wake.readable()
                elif waiting:
                    wake.tick()
            if asks_fd not in readable:
                continue
            try:
                asked = os.read(asks_fd, 64)
            except OSError:
                asked = b""
            if not asked:  # the kernel closed its end: nobody will ask again
                watched.unregister(asks_fd)
                watching.discard(asks_fd)
                continue
            with contextlib.suppress(Exception):  # a look must never harm the rank
                frame = main_thread_frame(self._thread)
                location = None if frame is None else locate(frame, outside_libraries)
                del frame
                self._send(Whereabouts(self.phase, location))


# The kernel's side -------------------------------------------------------------------


class Asker:
    """Asks ranks once, and keeps each one's answer as the line that shows it."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.answers: dict[int, str] = {}
        self.unreachable: set[int] = set()  # no pipe, or its end is gone: no answer will come
        self.deadline: float | None = None

    @property
    def asking(self) -> bool:
        return self.deadline is not None

    def ask(self, ranks: dict[int, int | None]) -> None:
        """Ask each rank (rank -> the kernel's end of its asking pipe; None: no pipe)."""
        self.deadline = time.monotonic() + ANSWER_WAIT_S
        for rank, fd in ranks.items():
            self.asked.append(rank)
            try:
                if fd is None:
                    raise BrokenPipeError
                os.write(fd, b"?")
            except OSError:  # a backend that does not carry the pipe, or the rank's end is gone
                self.unreachable.add(rank)

    def answered(self, rank: int, answer: Whereabouts) -> None:
        if rank in self.asked and rank not in self.answers:
            self.answers[rank] = said(answer)

    def waiting_for(self, alive: set[int]) -> bool:
        """Whether an asked rank that still runs has not answered, within the wait."""
        if self.deadline is None or time.monotonic() >= self.deadline:
            return False
        return any(
            r in alive and r not in self.answers and r not in self.unreachable for r in self.asked
        )

    def lines(self) -> dict[int, str]:
        """Each asked rank's answer, or that it gave none."""
        return {rank: self.answers.get(rank, NO_ANSWER) for rank in self.asked}


def said(answer: Whereabouts) -> str:
    """A rank's answer in words, with cells named as the notebook numbers them."""
    if answer.phase == "starting":
        return "was starting (its function had not begun)"
    if answer.phase == "returned":
        return "had returned, and was waiting for the other ranks to return"
    if answer.location is None:
        return "was not running Python code"
    return "was in " + describe(answer.location, _place)


def _place(filename: str, lineno: int) -> str:
    number = cell_names.cell_of(filename)
    return f"cell {number}, line {lineno}" if number is not None else f"{filename}:{lineno}"


def report_lines(lines: dict[int, str]) -> list[str]:
    """``rank 1 was in cell 5, line 3 (in train), in all_reduce (waiting for the others)``."""
    return [f"rank {rank} {text}" for rank, text in sorted(lines.items())]
