"""A launched rank's Python signal handlers run even while its main thread sleeps.

CPython runs a handler (the function's own SIGTERM handler that saves a checkpoint, say) in
the main thread, when that thread next checks for signals: a blocking call it is in (a
``time.sleep``, a lock, a socket) is cut short only when the signal interrupts that very
call. It does not when the signal came a moment before the call began (while the main
thread waited to take Python's lock back from another thread of the rank, after its last
check), nor when the kernel handed it to another thread of the rank: the main thread then
sleeps on, its handler waiting, up to the whole sleep.

So every signal that has a Python handler is also written to a wake-up descriptor
(``signal.set_wakeup_fd``), which the rank's side thread reads; it then sends a signal to
the main thread alone, whose own (empty) handler's call cuts the blocking call short, and
sends it again until the main thread has run its handlers (it checks all of them at once).
Signals that ask nothing urgent (a child's end, a window's size) wake nobody. Nothing of
this runs while no signal comes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

# Sent to the main thread alone; a real-time signal, which a program's own code seldom uses.
WAKE_MAIN = signal.SIGRTMIN if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
RETRY_S = 0.05  # how soon the main thread is woken again when it has not run its handlers
MAX_WAKES = 100  # then it is left alone: stuck in C code that does not return on a signal
# Signals whose handlers keep: nothing asks the rank to act at once. torch's data loader
# handles SIGCHLD as its workers end, while the main thread may be deep in a collective,
# whose blocking calls are then better left uninterrupted.
_NO_HURRY = frozenset(
    int(getattr(signal, name))
    for name in ("SIGCHLD", "SIGWINCH", "SIGURG", "SIGCONT")
    if hasattr(signal, name)
)


class SignalWake:
    """Installed by the rank's main thread; :meth:`readable` and :meth:`tick` are called by
    its side thread."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self.fd, False)
        self._main = threading.get_ident()
        self._handled = 0  # times the main thread ran WAKE_MAIN's handler
        self._seen = 0
        self._wakes = 0  # left for the signal being answered; 0: none waits
        signal.signal(WAKE_MAIN, self._on_wake)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=self._forget_in_child)

    @property
    def waiting(self) -> bool:
        """A signal came whose handlers the main thread has not run yet."""
        return self._wakes > 0

    def _on_wake(self, signum: int, frame: Any) -> None:
        self._handled += 1

    def readable(self) -> None:
        """Signals arrived: wake the main thread unless they were our own wake-ups."""
        try:
            data = os.read(self.fd, 512)
        except OSError:
            return
        if any(signum != WAKE_MAIN and signum not in _NO_HURRY for signum in data):
            self._seen = self._handled
            self._wakes = MAX_WAKES
            self._wake()

    def tick(self) -> None:
        """``RETRY_S`` after a wake-up: again, unless the main thread ran its handlers."""
        if self._handled != self._seen:
            self._wakes = 0
        elif self._wakes > 0:
            self._wake()

    def _wake(self) -> None:
        self._wakes -= 1
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(self._main, WAKE_MAIN)

    def _forget_in_child(self) -> None:
        # A process the rank forks (a data loader worker) must not write into the rank's pipe.
        with contextlib.suppress(ValueError, OSError):
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, self._write_fd):  # someone else's: put it back
                signal.set_wakeup_fd(previous)
