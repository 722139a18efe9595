"""The dashboard's rows and headline as HTML (pure functions of the launch record).

One HTML widget holds the whole table, so a redraw is one small message however many
ranks there are. Colours are fixed mid-tones and text inherits the frontend's colour,
so the table reads in light and dark themes alike; nothing is fetched at render time.
"""

from __future__ import annotations

import html

from notebook_launcher.widgets.plot import rank_colour
from notebook_launcher.widgets.record import LaunchRecord, RankRow
from notebook_launcher.widgets.text import format_seconds, headline, metrics_text, shorten

STATE_COLOURS = {
    "starting": "#7f7f7f",
    "running": "#1f77b4",
    "done": "#2ca02c",
    "failed": "#d62728",
    "stopped": "#8c6d31",
}
OUTCOME_MARKS = {"ok": ("✔", "#2ca02c")}
_FAILED_ROW = "background: rgba(214, 39, 40, 0.12);"
_CELL = "padding: 3px 10px 3px 0; vertical-align: middle; white-space: nowrap;"
_LINE_WIDTH = 120
# The last line is cut to the width left in the cell, with an ellipsis (the full text is in
# the rank's output below).
_LAST_CELL = " max-width: 36em; overflow: hidden; text-overflow: ellipsis;"


def header_html(record: LaunchRecord, now: float) -> str:
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
    parts.append("</div>")
    return "".join(parts)


def rows_html(record: LaunchRecord, now: float) -> str:
    head = "".join(
        f'<th style="{_CELL} text-align: left; font-weight: 600; opacity: 0.7;">{title}</th>'
        for title in ("rank", "state", "device", "pid", "elapsed", "progress", "metrics", "last line")
    )
    body = "".join(_row_html(record.rows[rank], now) for rank in sorted(record.rows))
    return (
        '<table style="border-collapse: collapse; font-size: 12.5px; margin: 2px 0 6px 0;">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _row_html(row: RankRow, now: float) -> str:
    elapsed = row.elapsed(now)
    swatch = (
        f'<span style="display: inline-block; width: 10px; height: 10px; border-radius: 2px; '
        f'margin-right: 6px; background: {rank_colour(row.rank)};"></span>'
    )
    state = (
        f'<span class="nl-state" style="background: {STATE_COLOURS.get(row.state, "#7f7f7f")}; '
        f'color: white; border-radius: 9px; padding: 1px 9px; font-size: 11.5px;">{row.state}</span>'
    )
    if row.error is not None:
        detail = (
            f'<span style="color: #d62728; font-weight: 600;">{html.escape(shorten(row.error, _LINE_WIDTH))}</span>'
        )
    else:
        detail = html.escape(shorten(row.last_line, _LINE_WIDTH))
    cells = [
        f"{swatch}{row.rank}",
        state,
        html.escape(row.device or "-"),
        str(row.pid or "-"),
        format_seconds(elapsed) if elapsed is not None else "-",
        _progress_html(row),
        html.escape(metrics_text(row)) if row.last_metrics else "-",
        f'<span style="font-family: var(--jp-code-font-family, monospace);">{detail}</span>',
    ]
    last = len(cells) - 1
    style = _FAILED_ROW if row.state == "failed" else ""
    tds = "".join(
        f'<td style="{_CELL}{_LAST_CELL if index == last else ""}">{cell}</td>'
        for index, cell in enumerate(cells)
    )
    return f'<tr class="nl-rank nl-{row.state}" data-rank="{row.rank}" style="{style}">{tds}</tr>'


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
            '<span style="display: inline-block; width: 120px; height: 8px; border-radius: 4px; '
            'background: rgba(128, 128, 128, 0.25); vertical-align: middle; margin-right: 6px;">'
            f'<span style="display: block; width: {fraction * 100:.1f}%; height: 100%; '
            f'border-radius: 4px; background: {colour};"></span></span>'
        )
    return f'{bar}<span class="nl-progress">{html.escape(progress.label())}</span>'


def output_html(row: RankRow, lines: int) -> str:
    """The rank's last ``lines`` lines, scrolled to the end (column-reverse keeps it there)."""
    text = "\n".join(list(row.output)[-lines:])
    return (
        '<div style="max-height: 260px; overflow: auto; display: flex; flex-direction: column-reverse;">'
        '<pre style="margin: 0; font-size: 12px; line-height: 1.35; white-space: pre-wrap;">'
        f"{html.escape(text) or '(no output yet)'}</pre></div>"
    )
