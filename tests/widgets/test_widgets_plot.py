"""The SVG plot and the lasting record: hover titles, NaN and inf, hostile names, colours."""

from __future__ import annotations

import math
import re
import xml.dom.minidom

import pytest

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.events import (
    LaunchFinished,
    LaunchStarted,
    OutputLine,
    RankFinished,
    RankStarted,
)
from notebook_launcher.widgets import history
from notebook_launcher.widgets.plot import render_svg
from notebook_launcher.widgets.record import DashboardRecord, clean_text
from notebook_launcher.widgets.static import record_html
from notebook_launcher.widgets.text import TextDashboard
from tests.support.metric_events import logged

HOSTILE = [
    "$\\frac$",
    "<img src=x onerror=alert(1)>",
    "x" * 10_000,
    "bytes \udcff\udcfe",
    "\x1b[31mred\x1b[0m",
]


@pytest.fixture(autouse=True)
def fresh_history():
    history.forget()
    yield
    history.forget()


def launched(
    metrics: list[tuple[int, dict[str, float], int | None]], ranks: int = 2
) -> DashboardRecord:
    record = DashboardRecord()
    record.apply(LaunchStarted(ranks, "fork", "cpu", "no", None))
    for rank in range(ranks):
        record.apply(RankStarted(rank, 100 + rank, "cpu"))
    for rank, values, step in metrics:
        record.apply(logged(rank, values, step))
    return record


def titles(svg: str) -> list[str]:
    document = xml.dom.minidom.parseString(svg)  # well-formed XML, whatever was logged
    return [t.firstChild.data for t in document.getElementsByTagName("title") if t.firstChild]


def test_hovering_a_point_tells_its_step_rank_and_value():
    record = launched(
        [(rank, {"loss": 1.0 / (step + 1 + rank)}, step) for step in range(5) for rank in range(2)]
    )
    drawn = render_svg(record.curves)
    assert "step 3, rank 1, loss = 0.2" in titles(drawn.svg)
    assert drawn.caption.startswith("10 points drawn of 10 logged")


def test_the_caption_counts_points_drawn_not_points_logged():
    record = launched([(0, {"loss": float(step)}, step) for step in range(50_000)], ranks=1)
    drawn = render_svg(record.curves)
    assert drawn.points < 1000
    assert drawn.caption.startswith(f"{drawn.points:,} points drawn of 50,000 logged")
    assert "step 49999, rank 0, loss = 49999" in titles(drawn.svg)  # ends at the latest point


def test_nan_and_inf_are_marked_and_an_all_nan_metric_says_so():
    values = [1.0, math.nan, 0.5, math.inf, 0.25, -math.inf]
    record = launched(
        [(0, {"loss": v, "broken": math.nan}, step) for step, v in enumerate(values)], ranks=1
    )
    drawn = render_svg(record.curves)
    shown = titles(drawn.svg)
    assert "step 1, rank 0, loss = nan" in shown and "step 3, rank 0, loss = inf" in shown
    assert "step 5, rank 0, loss = -inf" in shown
    assert "all values are NaN (6 logged)" in drawn.svg
    assert "9 NaN/inf values logged, marked with a cross" in drawn.caption
    assert drawn.caption.startswith("3 points drawn of 12 logged")


@pytest.mark.parametrize("name", HOSTILE)
def test_any_metric_name_is_drawn_escaped_and_never_breaks_the_picture(name):
    record = launched([(0, {name: 1.0}, 0), (0, {name: 2.0}, 1)], ranks=1)
    drawn = render_svg(record.curves)
    titles(drawn.svg)
    assert "<img" not in drawn.svg and "\x1b" not in drawn.svg and "[31m" not in drawn.svg
    assert len(drawn.svg) < 20_000
    drawn.svg.encode("utf-8")  # travels to the frontend as UTF-8


def test_sixteen_ranks_get_sixteen_distinct_colours():
    record = launched([(rank, {"loss": 1.0}, 0) for rank in range(16)], ranks=16)
    colours = re.findall(r'<g class="nl-point" fill="([^"]+)"', render_svg(record.curves).svg)
    assert len(set(colours)) == 16


def test_the_previous_launch_is_drawn_faded_beside():
    before = launched([(0, {"loss": 2.0 / (s + 1)}, s) for s in range(5)], ranks=1)
    now = launched([(0, {"loss": 1.0 / (s + 1)}, s) for s in range(5)], ranks=1)
    drawn = render_svg(now.curves, before.curves)
    assert "previous launch: rank 0, loss" in titles(drawn.svg)
    assert (
        'stroke-dasharray="4 3"' in drawn.svg and "previous launch in this kernel" in drawn.caption
    )


def test_ansi_colour_codes_and_bad_bytes_never_reach_the_record():
    assert (
        clean_text("\x1b[31mValueError\x1b[0m: \x1b]8;;http://x\x07link\x1b]8;;\x07 \udcff")
        == "ValueError: link ?"
    )
    record = launched([], ranks=1)
    record.apply(OutputLine(0, "stderr", "\x1b[1;31merror\x1b[0m in step", False))
    failure = RankFailure(
        0, 100, 1, "ValueError", "\x1b[31mboom\x1b[0m", "Traceback\n\x1b[31mValueError: boom\x1b[0m"
    )
    record.apply(RankFinished(0, 1, failure, "failed"))
    record.apply(LaunchFinished("failed", 1.0))
    page = record_html(record, None)
    assert "ValueError: boom" in page and "\x1b" not in page and "[31m" not in page
    assert record.rows[0].output[-1] == "[stderr] error in step"


def test_a_record_shows_the_failed_ranks_error_first_and_its_traceback():
    record = launched([(0, {"loss": 1.0}, 0)], ranks=2)
    failure = RankFailure(
        1,
        101,
        1,
        "ValueError",
        "<b>lr</b> too large",
        "Traceback (most recent call last):\nValueError: x",
    )
    record.apply(RankFinished(1, 1, failure, "failed"))
    record.apply(RankFinished(0, -15, None, "stopped"))
    record.apply(LaunchFinished("failed", 2.0))
    page = record_html(record, render_svg(record.curves))
    assert "ValueError: &lt;b&gt;lr&lt;/b&gt; too large" in page and "<b>lr" not in page
    assert "<details><summary>Traceback of rank 1</summary>" in page
    header = page.index("error / last line")
    assert header < page.index("progress") < page.index("metrics")  # the error comes first
    assert "<svg" in page and "<script" not in page


def test_launches_returns_the_kept_records_as_plain_data():
    board = TextDashboard(stream=open("/dev/null", "w"))
    board.on_event(LaunchStarted(1, "fork", "cpu", "no", None))
    board.on_event(RankStarted(0, 100, "cpu"))
    board.on_event(logged(0, {"loss": 0.5}, 3))
    board.on_event(RankFinished(0, 0, None))
    board.on_event(LaunchFinished("ok", 1.5))
    from notebook_launcher import launches

    (kept,) = launches()
    assert kept["outcome"] == "ok" and kept["elapsed"] == 1.5 and kept["num_processes"] == 1
    assert kept["ranks"][0]["state"] == "done" and kept["ranks"][0]["last_metrics"] == {"loss": 0.5}
    assert kept["metrics"] == {"loss": {0: {"steps": [3.0], "values": [0.5], "logged": 1}}}


def test_a_state_the_launcher_adds_is_shown_as_is():
    record = launched([], ranks=2)
    record.apply(RankFinished(1, None, None, "not started"))
    record.apply(LaunchFinished("failed", 1.0))
    assert record.rows[1].state == "not started" and record.rows[0].state == "stopped"


def path_points(d: str) -> list[tuple[float, float]]:
    """The points of a path drawn as "Mx y" then "l" steps, back in absolute pixels."""
    first, _, steps = d[1:].partition("l")
    x, y = map(float, first.split())
    points = [(x, y)]
    numbers = [float(n) for n in steps.split()]
    for dx, dy in zip(numbers[::2], numbers[1::2]):
        x, y = x + dx, y + dy
        points.append((x, y))
    return points


def test_each_line_passes_through_its_hover_points():
    record = launched(
        [(0, {"loss": 1.0 / (s + 1) + 0.01 * math.sin(s)}, s) for s in range(30)], ranks=1
    )
    document = xml.dom.minidom.parseString(render_svg(record.curves).svg)
    (line,) = [
        p for p in document.getElementsByTagName("path") if p.getAttribute("stroke-width") == "1.5"
    ]
    on_line = path_points(line.getAttribute("d"))
    circles = [
        (float(c.getAttribute("cx")), float(c.getAttribute("cy")))
        for c in document.getElementsByTagName("circle")
    ]
    assert len(on_line) == len(circles) == 30
    for (x, y), (cx, cy) in zip(on_line, circles):
        assert (
            abs(x - cx) < 0.06 and abs(y - cy) < 0.06
        )  # a tenth of a pixel, whatever the path's length


def test_many_ranks_over_long_runs_keep_a_record_of_moderate_size():
    # 16 ranks x 6 metrics x 5,000 steps: what the notebook keeps of the launch.
    record = launched(
        [
            (rank, {f"metric_{i}": 1.0 / (s + 1 + i) for i in range(6)}, s)
            for s in range(5000)
            for rank in range(16)
        ],
        ranks=16,
    )
    svg = render_svg(record.curves).svg
    assert len(svg) < 300_000
    document = xml.dom.minidom.parseString(svg)
    groups = document.getElementsByTagName("g")
    points = [
        len(g.getElementsByTagName("circle"))
        for g in groups
        if g.getAttribute("class") == "nl-point"
    ]
    assert len(points) == 16 * 6 and min(points) >= 12  # every curve still answers a hover


def test_axis_labels_between_thousands_read_as_plain_numbers():
    record = launched([(0, {"tokens_per_second": 1000.0 + s}, s) for s in range(30)], ranks=1)
    labels = re.findall(
        r'text-anchor="end" fill="currentColor" fill-opacity="0.7">([^<]+)<',
        render_svg(record.curves).svg,
    )
    assert labels[:3] == ["1000", "1014", "1029"]
