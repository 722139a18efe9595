"""The dashboard as plain text: where widgets cannot render (a terminal, a script), and
as the text form of the widget dashboard (what nbconvert to text and other frontends
without widgets show).

The rank's own lines are printed by the launcher's text printer; this adds what the
lines do not say: a status line now and then while ranks report progress or metrics,
and a table of final states, times and errors when the launch ends. It writes to
stderr, so a rank's stdout stays exactly what the rank printed.
"""

from __future__ import annotations

import sys
from typing import TextIO

from notebook_launcher.launcher.events import LaunchEvent, LaunchFinished, LaunchStarted
from notebook_launcher.rank_memory import MachineMemory, format_bytes
from notebook_launcher.widgets import history
from notebook_launcher.widgets.record import DashboardRecord, RankRow

STATUS_INTERVAL_S = 10.0
_LAST_LINE_WIDTH = 80
_OUTCOME_WORDS = {
    "ok": "finished",
    "failed": "failed",
    "timeout": "ran past its timeout",
    "interrupted": "was interrupted",
    "stopped": "was stopped",
    "error": "ended with an error",
}
_PRECISION_WORDS = {"no": "fp32"}


def headline(record: DashboardRecord, now: float) -> str:
    """``2 x cpu ranks, bf16, fork: running for 3.1 s`` (or how the launch ended)."""
    what = (
        f"{record.num_processes} x {record.accelerator} rank{'s' if record.num_processes != 1 else ''}, "
        f"{_PRECISION_WORDS.get(record.mixed_precision, record.mixed_precision)}, {record.start_method}"
    )
    if record.outcome is None:
        since = now - record.started_at if record.started_at is not None else 0.0
        return f"{what}: running for {format_seconds(since)}"
    words = _OUTCOME_WORDS.get(record.outcome, record.outcome)
    return f"{what}: {words} after {format_seconds(record.elapsed or 0.0)}"


def progress_text(row: RankRow) -> str:
    if row.progress is None:
        return "-"
    fraction = row.progress.fraction
    label = row.progress.label()
    return f"{fraction:4.0%} {label}" if fraction is not None else label


def metrics_text(row: RankRow, shown: int = 6) -> str:
    items = list(row.last_metrics.items())
    text = " ".join(f"{shorten(name, 24)}={value:.4g}" for name, value in items[:shown]) or "-"
    return text + (f" (+{len(items) - shown} more)" if len(items) > shown else "")


def memory_text(row: RankRow, machine: MachineMemory | None = None) -> str:
    """The rank's peak memory: ``412 MB`` (RSS), ``1.3 GB cuda, 2.1 GB RSS`` (allocated on
    its GPU, and its resident memory now), then the machine's RAM in use: ``· RAM 76%``."""
    memory = row.memory
    if memory is None:
        return "-"
    text = format_bytes(memory.peak_bytes)
    if memory.kind == "cuda":
        text = f"{text} cuda"
        if memory.rss_bytes is not None:
            text += f", {format_bytes(memory.rss_bytes)} RSS"
    if machine is not None:
        text += f" · {'⚠ ' if machine.warning else ''}RAM {machine.share:.0%}"
    return text


def machine_warning(record: DashboardRecord) -> str | None:
    """A line when the machine's RAM is nearly full, else None."""
    machine = record.machine_memory
    if machine is None or not machine.warning:
        return None
    return (
        f"The machine's {machine.text()} is in use: a rank that needs more is killed by the "
        "kernel's OOM killer. Load the model once per machine (main_process_first), in a "
        "smaller dtype, or use fewer ranks."
    )


def detail_text(row: RankRow) -> str:
    """The failing rank's error, else its last line of output."""
    text = row.error if row.error is not None else (row.where or row.last_line)
    return shorten(text, _LAST_LINE_WIDTH)


def table(record: DashboardRecord, now: float) -> str:
    """Every rank's row, in aligned columns under a header."""
    header = (
        "rank", "state", "device", "pid", "elapsed", "peak memory", "progress", "metrics",
        "last line / error",
    )  # fmt: skip
    rows = [header]
    for rank in sorted(record.rows):
        row = record.rows[rank]
        elapsed = row.elapsed(now)
        rows.append((
            str(rank), row.state, row.device or "-", str(row.pid or "-"),
            format_seconds(elapsed) if elapsed is not None else "-",
            memory_text(row, record.machine_memory),
            progress_text(row), metrics_text(row), detail_text(row),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(r, widths)) + "  " + r[-1] for r in rows
    ).rstrip()


def summary(record: DashboardRecord, now: float) -> str:
    """The headline, the table, and what limited the launch (where its ranks took steps)."""
    lines = [f"notebook_launcher: {headline(record, now)}", table(record, now)]
    warning = machine_warning(record)
    if warning:
        lines.append(warning)
    found = record.diagnosis()
    if found is not None:
        lines.append(found.sentence)
    return "\n".join(lines)


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def shorten(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` characters, for a table cell.

    (``shown_text.cut`` bounds a line that is shown whole, and says how much it left out.)
    """
    text = text.replace("\t", " ").strip()
    return text if len(text) <= width else text[: width - 1] + "…"


class TextDashboard:
    """A launch observer that prints the dashboard as text (to stderr by default)."""

    def __init__(self, stream: TextIO | None = None, interval: float = STATUS_INTERVAL_S) -> None:
        self._stream = stream
        self._interval = interval
        self.record = DashboardRecord()
        self._last_status = 0.0
        self._reported = (0, 0)  # (progress, curves) versions last shown in a status line

    def on_event(self, event: LaunchEvent) -> None:
        self.record.apply(event)
        if isinstance(event, LaunchStarted):
            self._last_status = self.record.now()  # the first status comes one interval in
        elif isinstance(event, LaunchFinished):
            history.keep(self.record)
            self._write(summary(self.record, self.record.now()))
        else:
            self._maybe_status()

    def _maybe_status(self) -> None:
        """Progress and metrics the lines may not show, at most once an interval."""
        now = self.record.now()
        versions = (self.record.progress_version, self.record.curves_version)
        if now - self._last_status < self._interval or versions == self._reported:
            return
        self._last_status, self._reported = now, versions
        parts = [
            f"rank {rank} {row.state} {progress_text(row)}"
            + (f" {metrics_text(row)}" if row.last_metrics else "")
            for rank, row in sorted(self.record.rows.items())
        ]
        since = format_seconds(now - (self.record.started_at or now))
        self._write(f"notebook_launcher: {since}: " + "; ".join(parts))

    def _write(self, text: str) -> None:
        stream = self._stream or sys.stderr  # looked up late: a kernel or pytest may swap it
        stream.write(text + "\n")
        stream.flush()
