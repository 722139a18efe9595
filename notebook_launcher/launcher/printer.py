"""Shows a launch as text: each rank's lines with a rank prefix, in the calling cell."""

from __future__ import annotations

import string
import sys
import time

from notebook_launcher.launcher.events import (
    GroupRestarting,
    LaunchEvent,
    LaunchStarted,
    OutputLine,
    RendezvousWaiting,
)
from notebook_launcher.rules import OUTPUT_MODES

__all__ = ["DEFAULT_PREFIX", "OUTPUT_MODES", "TextPrinter"]
DEFAULT_PREFIX = "[rank${rank}]: "
_PROGRESS_INTERVAL_S = 1.0


class TextPrinter:
    """Prints whole lines only, so lines of different ranks never merge.

    Progress bars redrawn with ``\\r`` are shown at most once a second per rank, then
    once more in their final state, instead of as hundreds of lines; with
    ``progress_lines=False`` (another observer shows progress) only the final state.
    """

    def __init__(
        self,
        output: str = "all",
        prefix_template: str | None = None,
        *,
        progress_lines: bool = True,
    ) -> None:
        self._output = output
        self._progress_lines = progress_lines
        self._template = string.Template(prefix_template or DEFAULT_PREFIX)
        self._prefixes: dict[int, str] = {}
        self._last_progress: dict[tuple[int, str], float] = {}

    def on_event(self, event: LaunchEvent) -> None:
        if isinstance(event, LaunchStarted) and event.fallback_reason and self._output != "none":
            print(
                f"notebook_launcher: using start_method='{event.start_method}' because "
                f"{event.fallback_reason}.",
                file=sys.stderr,
            )
        elif isinstance(event, OutputLine):
            self._print_line(event)
        elif isinstance(event, (GroupRestarting, RendezvousWaiting)) and self._output != "none":
            print(f"notebook_launcher: {event.line}", file=sys.stderr)

    def _print_line(self, line: OutputLine) -> None:
        if self._output == "none" or (self._output == "main" and line.rank != 0):
            return
        key = (line.rank, line.stream)
        if line.is_progress:
            if not self._progress_lines:
                return
            now = time.monotonic()
            last = self._last_progress.get(key)
            if last is not None and now - last < _PROGRESS_INTERVAL_S:
                return
            self._last_progress[key] = now
        else:
            self._last_progress.pop(key, None)
        stream = sys.stderr if line.stream == "stderr" else sys.stdout
        stream.write(self._prefix(line.rank) + line.text + "\n")

    def _prefix(self, rank: int) -> str:
        prefix = self._prefixes.get(rank)
        if prefix is None:
            prefix = self._template.safe_substitute(rank=rank, local_rank=rank, role_name="default")
            self._prefixes[rank] = prefix
        return prefix
