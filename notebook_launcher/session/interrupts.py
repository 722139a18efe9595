"""The stop button, pressed more than once while a session cell waits for its ranks.

The first press interrupts the ranks; the ranks then need a moment (a collective is cut
off, the process group rebuilt). People press again in that moment. A second press must
not end a session the first one was freeing, and must not land in the middle of showing
the first one's message: after the first press, later presses are counted instead of
raised, until the session says the ranks are stuck (then a press ends the session), or
until whoever shows the cell's error is done (see ``Session.hold_interrupts``).

Letting go depends on nothing outside the session: a session driven from a widget's
callback has no cell around it, and no one to say when its error was shown. The hold then
ends when the session's next call starts, or at the first press ``HOLD_S`` after the call
returned, which goes on to the handler that was there before.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

HOLD_S = 2.0  # after the call returned: presses this soon are the same person's second press


class StopPresses:
    """A SIGINT handler for the rest of one cell, installed at its first stop press."""

    def __init__(self) -> None:
        self.count = 0  # presses after the first
        self.ending = False  # set once the ranks were declared stuck: a press ends the session
        self._previous: Any = None
        self.installed = False
        self._returned_at: float | None = None  # when the call this handler held for returned

    def install(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        self._previous = previous if previous is not None else signal.default_int_handler
        signal.signal(signal.SIGINT, self._on_press)
        self.installed = True

    def returned(self) -> None:
        """The call is over: from ``HOLD_S`` on, a press is no longer this call's."""
        self._returned_at = time.monotonic()

    def release(self) -> None:
        """Put back the handler that was there before (in the main thread; harmless twice)."""
        if self.installed:
            self.installed = False
            if signal.getsignal(signal.SIGINT) == self._on_press:  # not replaced since
                signal.signal(signal.SIGINT, self._previous)

    def _on_press(self, signum: int, frame: Any) -> None:
        if self._returned_at is not None and time.monotonic() - self._returned_at > HOLD_S:
            # Nobody let go after the call (no cell around it): the press is for what runs now.
            previous = self._previous
            self.release()
            if callable(previous):
                previous(signum, frame)
            return
        self.count += 1
        if self.ending:
            raise KeyboardInterrupt
