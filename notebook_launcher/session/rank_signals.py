"""A session rank's signals: the kernel's interrupt, its "what are you doing?", and the wake-up
call, seen by a side thread even while the main thread is stuck in C++.

A cell can take them over (its own SIGINT handler, an asyncio loop that added a signal
handler and, closing, reset the wake-up descriptor). Each command therefore starts and
ends by putting them back, and says so in the cell when a cell had replaced them.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import select
import signal
import sys
import threading
from typing import Any, Callable

# How long an interrupted command may take to reach Python code again before the side thread
# looks at where the main thread is; each look that finds it inside a collective cuts the
# process group's connections (a collective blocked in C++ never sees the signal). A command
# that is only slow (a long computation, a sleep with the signals blocked) is left to finish.
LOOK_AFTER_S = 0.25

# Sent by the side thread to the main thread alone, to wake it from a blocking call; its
# handler does nothing (the interrupt's own handler then runs). A real-time signal where
# there are, as a program's own code seldom uses one.
WAKE_MAIN = signal.SIGRTMIN if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2

# Where the main thread's innermost Python frame is while torch waits for a collective:
# torch.distributed's functions, DDP, and autograd (a DDP backward's collectives run in
# autograd's threads while the main thread waits in backward()).
_COLLECTIVE_CODE = tuple(
    os.sep + os.path.join("torch", *parts) + os.sep
    for parts in (("distributed",), ("autograd",), ("nn", "parallel"))
)


def nothing_to_do_here(signum: int, frame: Any) -> None:
    """The handler of signals whose effect is elsewhere: SIGUSR1 needs a Python handler for
    Python to pass it to the side thread's wakeup descriptor, where it is answered; the
    wake-up call only has to interrupt the main thread's blocking call."""


def in_collective(frame: Any) -> bool:
    """Whether a thread whose innermost Python frame is ``frame`` may be waiting for peers:
    inside torch's collective code, or on a line of the cell that waits for an async one."""
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    if any(part in filename for part in _COLLECTIVE_CODE):
        return True
    return ".wait(" in linecache.getline(filename, frame.f_lineno)


class SignalWatch:
    """A side thread that sees the rank's signals even while the main thread is stuck in C++.

    SIGINT, the kernel's interrupt, becomes a KeyboardInterrupt while a command runs, and
    breaks the process group when the command is stuck in a collective. SIGUSR1 asks what
    the rank is doing: the thread sends a snapshot of the main thread.
    """

    _installed: SignalWatch | None = None  # a process has one: it owns the process's SIGINT

    @classmethod
    def whole_messages_of_this_process(cls) -> Any:
        watch = cls._installed
        return contextlib.nullcontext() if watch is None else watch.whole_messages()

    def __init__(self, break_group: Callable[[], None], answer: Callable[[], None]) -> None:
        self._break_group = break_group
        self._answer = answer
        self._running = False
        self.signalled = False  # an interrupt arrived while the current command ran
        self._deferring = 0  # depth of whole_messages() blocks in the main thread
        self._deferred = False  # an interrupt came in such a block
        self._idle = threading.Event()
        self._idle.set()
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._main = threading.main_thread().ident or 0
        self.reclaim()
        self._thread = threading.Thread(
            target=self._watch, args=(read_fd,), name="notebook_launcher-interrupt", daemon=True
        )
        self._thread.start()
        SignalWatch._installed = self

    def reclaim(self) -> list[str]:
        """In the main thread: the handlers, the wake-up descriptor (which Python's C-level
        handler writes to even while the main thread is stuck in C++) and the main thread's
        mask as this watch needs them; what had been replaced."""
        replaced = []
        for signum, handler in (
            (signal.SIGINT, self._on_signal),
            (signal.SIGUSR1, nothing_to_do_here),
            (WAKE_MAIN, nothing_to_do_here),
        ):
            if signal.getsignal(signum) != handler:
                signal.signal(signum, handler)
                replaced.append(f"the handler of {signal.Signals(signum).name}")
        if signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False) != self._write_fd:
            replaced.append("the wake-up descriptor of signals")
        # SIGUSR1 is for the side thread alone (a main thread inside a C++ collective is never
        # woken by it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        return replaced

    def _reclaim_and_say(self) -> None:
        replaced = self.reclaim()
        if replaced and SignalWatch._installed is self:
            print(
                f"notebook_launcher: the cell replaced {' and '.join(replaced)}, which the stop "
                "button and %distributed where need on the ranks; they are put back (a cell's own "
                "handler lasts until the cell ends).",
                file=sys.stderr,
                flush=True,
            )

    @contextlib.contextmanager
    def running(self) -> Any:
        """Around one command, in the main thread."""
        self._reclaim_and_say()
        self.signalled = self._deferred = False
        self._idle.clear()
        self._running = True
        try:
            yield
        finally:
            self._running = False
            self._idle.set()
            self._reclaim_and_say()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._running:
            self.signalled = True
            if self._deferring:
                self._deferred = True
                return
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def whole_messages(self) -> Any:
        """The main thread's reads and writes of a pipe message finish before an interrupt
        is raised: a message cut in half would garble every one after it. An interrupt that
        came meanwhile is raised when the block ends (if the command still runs)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # the handler raises in the main thread only
            return
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._deferred:
            self._deferred = False
            if self._running:
                raise KeyboardInterrupt

    def _watch(self, read_fd: int) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # blocked in the main thread
        interrupted = False  # an interrupt the main thread has not answered yet
        # poll, not select: a rank forked from a kernel holding a thousand descriptors gets
        # pipe numbers that select() refuses.
        watched = select.poll()
        watched.register(read_fd, select.POLLIN)
        while True:
            if interrupted:
                # Looks are taken between reads, so "what are you doing?" is still answered.
                readable = watched.poll(LOOK_AFTER_S * 1000)
                if self._idle.is_set():
                    interrupted = False
                elif not readable:
                    if in_collective(sys._current_frames().get(self._main)):
                        self._break_group()
                        interrupted = False
                    continue
            data = os.read(read_fd, 64)
            if not data:
                return
            if signal.SIGUSR1 in data:
                self._answer()
            if signal.SIGINT not in data or self._idle.is_set():
                continue
            self.signalled = True
            # The kernel's SIGINT goes to the process, and Linux may hand it to any thread
            # that does not block it (this one, torch's, the memory reporter's). Python then
            # runs the handler in the main thread only when that thread next wakes: a main
            # thread asleep (time.sleep, a lock, a socket) would not see it until it wakes by
            # itself. A signal sent to the main thread alone wakes it, to run the handler.
            with contextlib.suppress(OSError):
                signal.pthread_kill(self._main, WAKE_MAIN)
            interrupted = True
