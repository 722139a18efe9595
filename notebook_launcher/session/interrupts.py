"""The stop button, pressed more than once while a session cell waits for its ranks.

The first press interrupts the ranks; the ranks then need a moment (a collective is cut
off, the process group rebuilt). People press again in that moment. A second press must
not end a session the first one was freeing, and must not land in the middle of showing
the first one's message: after the first press, later presses are counted instead of
raised, until the session says the ranks are stuck (then a press ends the session), or
until whoever shows the cell's error is done (see ``Session.hold_interrupts``).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopPresses:
    """A SIGINT handler for the rest of one cell, installed at its first stop press."""

    def __init__(self) -> None:
        self.count = 0  # presses after the first
        self.ending = False  # set once the ranks were declared stuck: a press ends the session
        self._previous: Any = None
        self.installed = False

    def install(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        self._previous = previous if previous is not None else signal.default_int_handler
        signal.signal(signal.SIGINT, self._on_press)
        self.installed = True

    def release(self) -> None:
        if self.installed:
            self.installed = False
            signal.signal(signal.SIGINT, self._previous)

    def _on_press(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.ending:
            raise KeyboardInterrupt
