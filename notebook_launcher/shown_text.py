"""How much of one line of text a rank sent is shown: its first 2,000 characters.

A rank may print a 100 MB line or raise an exception with a 10 MB message. Shown whole, it
would be sent to the frontend again with every redraw, saved into the notebook with the
launch's record and repeated in the error the notebook shows. What is cut says how much
was left out; the cell's own output and the rank's exception itself keep all of it.
"""

from __future__ import annotations

LINE_CHARS = 2000


def cut(line: str, limit: int = LINE_CHARS) -> str:
    """``line`` as shown: at most ``limit`` characters, then how many more there were."""
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… ({len(line) - limit:,} more characters)"


def cut_lines(text: str, limit: int = LINE_CHARS) -> str:
    """Each line of ``text`` cut as ``cut`` does (a traceback ends with the message)."""
    if len(text) <= limit:
        return text
    return "\n".join(cut(line, limit) for line in text.split("\n"))
