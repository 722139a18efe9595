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
        self._pending = ""  # text since the last \r or \n
        self._redrawn = ""  # the last state ended by \r, shown until something replaces it

    def feed(self, data: bytes) -> list[tuple[str, bool]]:
        return self._split(self._decoder.decode(data))

    def close(self) -> list[tuple[str, bool]]:
        """Flush at end of stream: an unterminated last line is still a line."""
        pieces = self._split(self._decoder.decode(b"", final=True))
        last = self._pending or self._redrawn
        if last:
            pieces.append((last, False))
        self._pending = self._redrawn = ""
        return pieces

    def _split(self, text: str) -> list[tuple[str, bool]]:
        pieces: list[tuple[str, bool]] = []
        start = 0
        for match in _LINE_BREAK.finditer(text):
            self._pending += text[start : match.start()]
            start = match.end()
            if match.group() != "\r":
                pieces.append((self._pending or self._redrawn, False))
                self._pending = self._redrawn = ""
            elif self._pending:
                self._redrawn = self._pending
                pieces.append((self._pending, True))
                self._pending = ""
        self._pending += text[start:]
        return pieces
