"""The lasting record of a launch: plain outputs that need no kernel and no widget state.

Jupyter saves no widget state by default, so a reopened notebook would show "model not
found" where the live dashboard was. When a launch ends, the dashboard's output is
replaced by this record: an HTML table of final states, times and errors, the plot as an
inline SVG (its points' ``<title>`` tooltips still work) and each failed rank's
traceback in a ``<details>`` element. GitHub's viewer strips scripts and some style
attributes: the record reads without them (a plain table, colours only as a bonus).
"""

from __future__ import annotations

import html

from notebook_launcher.shown_text import cut_lines
from notebook_launcher.widgets.html import STATE_COLOURS, css_word, plot_caption
from notebook_launcher.widgets.plot import Drawn, rank_colour
from notebook_launcher.widgets.record import DashboardRecord, clean_text
from notebook_launcher.widgets.text import (
    format_seconds,
    headline,
    machine_warning,
    memory_text,
    progress_text,
    shorten,
)

_ERROR_CHARS = 600
_TRACEBACK_LINES = 60
_CELL = ' style="padding: 2px 10px 2px 0; text-align: left; vertical-align: top;"'


def record_html(
    record: DashboardRecord, drawn: Drawn | None, plot_problem: str | None = None
) -> str:
    now = record.now()
    ok = record.outcome == "ok"
    mark = (
        '<span style="color: #2ca02c;">✔</span>' if ok else '<span style="color: #d62728;">✘</span>'
    )
    parts = [
        '<div class="nl-record">',
        f"<p>{mark} <b>notebook_launcher</b> {html.escape(headline(record, now))}</p>",
    ]
    if record.notice:
        parts.append(f"<p>{html.escape(shorten(record.notice, _ERROR_CHARS))}</p>")
    titles = (
        "rank",
        "state",
        "elapsed",
        "error / last line",
        "progress",
        "metrics",
        "peak memory",
        "device",
    )
    head = "".join(f"<th{_CELL}>{t}</th>" for t in titles)
    rows = []
    for rank in sorted(record.rows):
        row = record.rows[rank]
        elapsed = row.elapsed(now)
        colour = STATE_COLOURS.get(row.state, "#7f7f7f")
        if row.error is not None:
            detail = (
                f'<b style="color: #d62728;">{html.escape(shorten(row.error, _ERROR_CHARS))}</b>'
            )
        elif row.where is not None:  # ended from outside: where it was then
            detail = f"<code>{html.escape(shorten(row.where, _ERROR_CHARS))}</code>"
        else:
            detail = (
                f"<code>{html.escape(shorten(row.last_line, 200))}</code>" if row.last_line else ""
            )
        metrics = " ".join(
            f"{html.escape(shorten(n, 24))}={v:.4g}" for n, v in list(row.last_metrics.items())[:8]
        )
        if len(row.last_metrics) > 8:
            metrics += f" (+{len(row.last_metrics) - 8} more)"
        cells = [
            f'<span style="color: {rank_colour(rank)};">■</span> {rank}',
            f'<b style="color: {colour};">{html.escape(row.state)}</b>',
            format_seconds(elapsed) if elapsed is not None else "-",
            detail,
            html.escape(shorten(progress_text(row), 60)),
            metrics or "-",
            f'<span class="nl-memory">{html.escape(memory_text(row, record.machine_memory))}</span>',
            html.escape(row.device or "-"),
        ]
        rows.append(
            f'<tr class="nl-rank nl-{css_word(row.state)}" data-rank="{rank}">'
            + "".join(f"<td{_CELL}>{c}</td>" for c in cells)
            + "</tr>"
        )
    parts.append(
        f'<table class="nl-record-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )
    warning = machine_warning(record)
    if warning:
        parts.append(f'<p class="nl-ram-warning">⚠ {html.escape(warning)}</p>')
    found = record.diagnosis()
    if found is not None:
        parts.append(f'<p class="nl-diagnosis">{html.escape(found.sentence)}</p>')
    if drawn is not None and drawn.svg:
        parts.append(f"<div>{drawn.svg}</div>")
        parts.append(f"<p><small>{plot_caption(record, drawn)}</small></p>")
    if plot_problem:
        parts.append(
            f"<p><small>The plot could not be drawn: {html.escape(plot_problem)}</small></p>"
        )
    for rank, failure in sorted(record.failures.items()):
        text = clean_text(cut_lines(failure.traceback or failure.output_tail or failure.summary()))
        lines = text.rstrip().splitlines()[-_TRACEBACK_LINES:]
        parts.append(
            f"<details><summary>Traceback of rank {rank}</summary>"
            f"<pre>{html.escape(chr(10).join(lines))}</pre></details>"
        )
    parts.append("</div>")
    return "".join(parts)
