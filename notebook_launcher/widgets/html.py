"""The dashboard's rows and headline as HTML (pure functions of the launch record).

One HTML widget holds the whole table, so a redraw is one small message however many
ranks there are. Colours are fixed mid-tones and text inherits the frontend's colour,
so the table reads in light and dark themes alike; nothing is fetched at render time.
"""

from __future__ import annotations

import html
import itertools

from notebook_launcher.rank_memory import MachineMemory
from notebook_launcher.widgets.plot import Drawn, rank_colour
from notebook_launcher.widgets.record import DashboardRecord, RankRow
from notebook_launcher.widgets.text import (
    format_seconds,
    headline,
    machine_warning,
    memory_text,
    shorten,
)

STATE_COLOURS = {
    "starting": "#7f7f7f",
    "running": "#1f77b4",
    "done": "#2ca02c",
    "failed": "#d62728",
    "stopped": "#8c6d31",
    "not started": "#7f7f7f",
}
OUTCOME_MARKS = {"ok": ("✔", "#2ca02c")}
_FAILED_ROW = "background: rgba(214, 39, 40, 0.12);"
_CELL = "padding: 2px 8px 2px 0; vertical-align: top; text-align: left;"
# Column widths of the fixed layout: the table never grows past its output area, and the
# error (or last line) comes right after the state, wrapping instead of running off.
_COLUMNS = (
    ("rank", "3.4em"), ("state", "6.6em"), ("elapsed", "5.4em"), ("error / last line", "auto"),
    ("progress", "19%"), ("metrics", "26%"), ("peak memory", "6.2em"), ("device", "4.2em"),
    ("pid", "4.2em"),
)  # fmt: skip
_DETAIL_CHARS = 300  # the error or last line, wrapped; the full text is in the rank's output
_DESCRIPTION_CHARS = 24
_METRICS_SHOWN = 6


def header_html(record: DashboardRecord, now: float) -> str:
    mark, colour = OUTCOME_MARKS.get(record.outcome or "", ("✘", "#d62728"))
    if record.outcome is None:
        mark, colour = "●", "#1f77b4"
    parts = [
        f'<div style="font-size: 13px; line-height: 1.6;">'
        f'<span style="color: {colour}; font-weight: bold;">{mark}</span> '
        f"<b>notebook_launcher</b> &nbsp;{html.escape(headline(record, now))}"
    ]
    if record.fallback_reason:
        parts.append(
            f'<br><span style="opacity: 0.75;">start method {html.escape(record.start_method)} '
            f"because {html.escape(record.fallback_reason)}</span>"
        )
    if record.notice:
        parts.append(
            f'<br><span style="opacity: 0.85;">{html.escape(shorten(record.notice, _DETAIL_CHARS))}</span>'
        )
    warning = machine_warning(record)
    if warning:
        parts.append(
            f'<br><span class="nl-ram-warning" style="color: #d62728;">⚠ {html.escape(warning)}</span>'
        )
    found = record.diagnosis()
    if found is not None:
        parts.append(f'<br><span class="nl-diagnosis">{html.escape(found.sentence)}</span>')
    parts.append("</div>")
    return "".join(parts)


def rows_html(record: DashboardRecord, now: float) -> str:
    cols = "".join(f'<col style="width: {width};">' for _, width in _COLUMNS)
    head = "".join(
        f'<th style="{_CELL} font-weight: 600; opacity: 0.7; white-space: nowrap;">{title}</th>'
        for title, _ in _COLUMNS
    )
    body = "".join(
        _row_html(record.rows[rank], now, record.machine_memory) for rank in sorted(record.rows)
    )
    return (
        '<table style="border-collapse: collapse; font-size: 12.5px; margin: 2px 0 6px 0; '
        'width: 100%; table-layout: fixed;">'
        f"<colgroup>{cols}</colgroup><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _row_html(row: RankRow, now: float, machine: MachineMemory | None = None) -> str:
    elapsed = row.elapsed(now)
    swatch = (
        f'<span style="display: inline-block; width: 10px; height: 10px; border-radius: 2px; '
        f'margin-right: 5px; background: {rank_colour(row.rank)};"></span>'
    )
    state = (
        f'<span class="nl-state" style="background: {STATE_COLOURS.get(row.state, "#7f7f7f")}; '
        f'color: white; border-radius: 9px; padding: 0 8px; font-size: 11.5px; white-space: nowrap;">'
        f"{html.escape(row.state)}</span>"
    )
    cells = [
        f"{swatch}{row.rank}",
        state,
        format_seconds(elapsed) if elapsed is not None else "-",
        _detail_html(row),
        _progress_html(row),
        _metrics_html(row),
        _memory_html(row, machine),
        html.escape(row.device or "-"),
        str(row.pid or "-"),
    ]
    style = _FAILED_ROW if row.state == "failed" else ""
    wrap = " overflow-wrap: anywhere; word-break: break-word;"
    tds = "".join(f'<td style="{_CELL}{wrap}">{cell}</td>' for cell in cells)
    return f'<tr class="nl-rank nl-{css_word(row.state)}" data-rank="{row.rank}" style="{style}">{tds}</tr>'


def _detail_html(row: RankRow) -> str:
    code = "font-family: var(--jp-code-font-family, monospace); font-size: 12px;"
    if row.error is not None:
        return (
            f'<span class="nl-error" style="{code} color: #d62728; font-weight: 600;">'
            f"{html.escape(shorten(row.error, _DETAIL_CHARS))}</span>"
        )
    if row.where is not None:  # ended from outside: where it was then
        return f'<span class="nl-where" style="{code}">{html.escape(shorten(row.where, _DETAIL_CHARS))}</span>'
    return f'<span class="nl-last" style="{code}">{html.escape(shorten(row.last_line, _DETAIL_CHARS))}</span>'


def _metrics_html(row: RankRow) -> str:
    if not row.last_metrics:
        return "-"
    items = list(row.last_metrics.items())
    shown = " ".join(
        f'<span style="white-space: nowrap; font-size: 11.5px;">{html.escape(shorten(name, 24))}={value:.4g}</span>'
        for name, value in items[:_METRICS_SHOWN]
    )
    if len(items) > _METRICS_SHOWN:
        shown += f' <span style="opacity: 0.6;">+{len(items) - _METRICS_SHOWN} more</span>'
    return shown


def _memory_html(row: RankRow, machine: MachineMemory | None = None) -> str:
    memory = row.memory
    if memory is None:
        return '<span style="opacity: 0.5;">-</span>'
    what = "peak CUDA memory allocated" if memory.kind == "cuda" else "peak resident memory (RSS)"
    if machine is not None:
        what += f"; the machine's {machine.text()} in use"
    colour = " color: #d62728;" if machine is not None and machine.warning else ""
    return (
        f'<span class="nl-memory" title="{html.escape(what)} on {html.escape(memory.device)}" '
        f'style="white-space: nowrap;{colour}">{html.escape(memory_text(row, machine))}</span>'
    )


def css_word(state: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in state)


def _progress_html(row: RankRow) -> str:
    progress = row.progress
    if progress is None:
        return '<span style="opacity: 0.5;">-</span>'
    fraction = progress.fraction
    colour = STATE_COLOURS["done"] if fraction == 1.0 else STATE_COLOURS["running"]
    if fraction is None:  # no total: a count only
        bar = ""
    else:
        bar = (
            '<span style="display: inline-block; width: 80px; height: 8px; border-radius: 4px; '
            'background: rgba(128, 128, 128, 0.25); vertical-align: middle; margin-right: 6px; max-width: 40%;">'
            f'<span style="display: block; width: {fraction * 100:.1f}%; height: 100%; '
            f'border-radius: 4px; background: {colour};"></span></span>'
        )
    label = progress.label()
    if progress.description and len(progress.description) > _DESCRIPTION_CHARS:
        label = label.replace(
            progress.description, shorten(progress.description, _DESCRIPTION_CHARS), 1
        )
    return f'{bar}<span class="nl-progress">{html.escape(label)}</span>'


OUTPUT_CHARS_SHOWN = 100_000  # of a rank's output panel, sent again whenever a line comes


def output_html(row: RankRow, lines: int) -> str:
    """The rank's last ``lines`` lines (at most OUTPUT_CHARS_SHOWN characters of them),
    scrolled to the end (column-reverse keeps it there)."""
    shown: list[str] = []
    size = 0
    for line in itertools.islice(reversed(row.output), lines):
        size += len(line) + 1
        if size > OUTPUT_CHARS_SHOWN and shown:
            break
        shown.append(line)
    text = "\n".join(reversed(shown))
    return (
        '<div style="max-height: 260px; overflow: auto; display: flex; flex-direction: column-reverse;">'
        '<pre style="margin: 0; font-size: 12px; line-height: 1.35; white-space: pre-wrap;">'
        f"{html.escape(text) or '(no output yet)'}</pre></div>"
    )


def plot_caption(record: DashboardRecord, drawn: Drawn) -> str:
    """Under the plot, as HTML: what it shows, and what was logged but not kept."""
    note = record.metrics_note()
    return html.escape(f"{drawn.caption}; {note}" if note else drawn.caption)
