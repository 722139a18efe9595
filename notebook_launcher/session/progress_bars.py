"""The ranks' tqdm bars, drawn in the cell as bars that update in place, one per rank.

A rank's bar arrives as text redrawn with ``\\r`` (in a session rank, tqdm's notebook
variants draw text too: ``rich_output``). Printed, the states of two ranks' bars would
follow one another line by line; in a notebook each bar gets a display of its own,
labelled with its rank and updated where it stands, and ends in its final state. Lines
that are not tqdm's, and every line outside a notebook, go to the printer.
"""

from __future__ import annotations

import dataclasses
import html
import time
from typing import Any

from notebook_launcher.launcher.events import LaunchEvent, LaunchObserver, OutputLine
from notebook_launcher.widgets.progress_text import TextProgress, parse_progress_line

# A bar is redrawn in the cell at most this often (its final state always).
_REDRAW_S = 0.2


@dataclasses.dataclass
class _Bar:
    handle: Any  # IPython's DisplayHandle
    drawn_at: float


class ProgressBars:
    """Forwards events to ``printer``, except the bar lines it draws itself."""

    def __init__(self, printer: LaunchObserver, output: str = "all") -> None:
        self._printer = printer
        self._output = output
        self._bars: dict[tuple[int, str], _Bar] = {}
        self._in_a_notebook = _in_a_notebook()  # a session lives in one kernel

    def on_event(self, event: LaunchEvent) -> None:
        if not (isinstance(event, OutputLine) and self._draw(event)):
            self._printer.on_event(event)

    def new_cell(self) -> None:
        """A bar left unfinished (its cell was stopped) is not continued by the next cell's."""
        self._bars.clear()

    def _draw(self, line: OutputLine) -> bool:
        if self._output == "none" or (self._output == "main" and line.rank != 0):
            return False
        if not self._in_a_notebook:
            return False
        state = parse_progress_line(line.text)
        if state is None:
            return False
        from IPython.display import display

        key = (line.rank, line.stream)
        bar = self._bars.get(key)
        now = time.monotonic()
        bundle = _bundle(line.rank, line.text, state)
        if bar is None:
            handle = display(bundle, raw=True, display_id=True)
            bar = self._bars[key] = _Bar(handle, now)
        elif not line.is_progress or now - bar.drawn_at >= _REDRAW_S:
            bar.handle.update(bundle, raw=True)
            bar.drawn_at = now
        if not line.is_progress:  # the bar's last state, ended with a newline
            del self._bars[key]
        return True


def _in_a_notebook() -> bool:
    try:
        from IPython.core.getipython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _bundle(rank: int, text: str, state: TextProgress) -> dict[str, str]:
    if state.total:
        fraction = min(max(state.n / state.total, 0.0), 1.0)
        bar = f'<progress value="{fraction:.4f}" max="1" style="width: 16em"></progress>'
        counts = f"{fraction:.0%} {_count(state.n)}/{_count(state.total)}"
    else:
        bar, counts = "", _count(state.n)
    details = ", ".join(
        part for part in (state.remaining and f"{state.remaining} left", state.rate) if part
    )
    label = f"rank {rank}" + (f" · {state.description}" if state.description else "")
    markup = (
        '<div style="font-family: var(--jp-code-font-family, monospace); font-size: 0.9em">'
        f"<b>{html.escape(label)}</b> {bar} {html.escape(counts)}"
        + (f' <span style="opacity: 0.7">[{html.escape(details)}]</span>' if details else "")
        + "</div>"
    )
    return {"text/plain": f"[rank{rank}]: {text}", "text/html": markup}


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
