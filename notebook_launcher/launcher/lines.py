"""Turning a rank's raw output bytes into whole lines and progress-bar states."""

from __future__ import annotations

import codecs
import re

_LINE_BREAK = re.compile("\\r?\\n|\\r")  # a Windows line end is one break


class LineSplitter:
    """Splits one stream into complete lines, treating ``\\r`` as a terminal would.

    ``feed`` returns ``(text, is_progress)`` pairs: a finished line, or the latest state
    of a line being redrawn with carriage returns (a tqdm bar). Partial lines are held
    until their newline arrives, so lines from different ranks never merge.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Text since the last \r or \n, as the pieces it arrived in: joined once, when the
        # line ends, so a line fed in a million reads costs its length, not its square.
        self._pending: list[str] = []
        self._redrawn = ""  # the last state ended by \r, shown until something replaces it

    def feed(self, data: bytes) -> list[tuple[str, bool]]:
        return self._split(self._decoder.decode(data))

    def close(self) -> list[tuple[str, bool]]:
        """Flush at end of stream: an unterminated last line is still a line."""
        pieces = self._split(self._decoder.decode(b"", final=True))
        last = self._take_pending() or self._redrawn
        if last:
            pieces.append((last, False))
        self._redrawn = ""
        return pieces

    def flush(self) -> list[tuple[str, bool]]:
        """The unfinished line, as a line, while the stream goes on (a session cell ended)."""
        last = self._take_pending()
        return [(last, False)] if last else []

    @property
    def pending_pieces(self) -> int:
        """How many unjoined pieces the unfinished line is held as."""
        return len(self._pending)

    def _take_pending(self) -> str:
        text = "".join(self._pending)
        self._pending.clear()
        return text

    def _split(self, text: str) -> list[tuple[str, bool]]:
        pieces: list[tuple[str, bool]] = []
        start = 0
        for match in _LINE_BREAK.finditer(text):
            if match.start() > start:
                self._pending.append(text[start : match.start()])
            start = match.end()
            line = self._take_pending()
            if match.group() != "\r":
                pieces.append((line or self._redrawn, False))
                self._redrawn = ""
            elif line:
                self._redrawn = line
                pieces.append((line, True))
        if start < len(text):
            self._pending.append(text[start:])
        return pieces
