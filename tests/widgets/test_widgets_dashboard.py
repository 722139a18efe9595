"""The widget dashboard: throttled redraws, a drawn plot, a record that stays afterwards."""

from __future__ import annotations

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
from notebook_launcher.widgets._compat import titles
from notebook_launcher.widgets.dashboard import SHOW_AFTER_S, DashboardWarning, WidgetDashboard
from notebook_launcher.widgets.plot import render_svg
from notebook_launcher.widgets.record import Curve
from tests.support.metric_events import logged


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def close_widgets():
    """Close this test's widgets while their comms exist (not at interpreter exit)."""
    yield
    import ipywidgets

    ipywidgets.Widget.close_all()


def svg_width(svg: str) -> int:
    xml.dom.minidom.parseString(svg)  # well-formed, whatever the names
    return int(re.search(r'width="(\d+)"', svg).group(1))


@pytest.fixture(autouse=True)
def fresh_history():
    history.forget()
    yield
    history.forget()


@pytest.fixture
def board(capsys):
    clock = Clock()
    dashboard = WidgetDashboard(clock, tick_s=None, show_after_s=0)  # redraws driven by events only
    dashboard.on_event(LaunchStarted(2, "fork", "cpu", "no", None))
    for rank in range(2):
        dashboard.on_event(RankStarted(rank, 1000 + rank, "cpu"))
    yield dashboard, clock
    capsys.readouterr()  # outside a kernel, display() prints the bundle


def count_changes(widget) -> list[object]:
    seen: list[object] = []
    widget.observe(lambda change: seen.append(change["new"]), names="value")
    return seen


def test_a_fast_loop_is_drawn_a_few_times_a_second_not_per_event(board):
    dashboard, clock = board
    rows, plot = count_changes(dashboard.rows), count_changes(dashboard.plot)
    outputs = count_changes(dashboard.outputs[0])
    for step in range(10_000):  # 1,000 metrics and 1,000 lines a second for 10 s
        clock.now += 0.001
        dashboard.on_event(logged(step % 2, {"loss": 1 / (step + 1)}, step // 2))
        dashboard.on_event(OutputLine(0, "stdout", f"step {step}", False))
    assert 1 <= len(plot) <= 11  # at most once a second (less when drawing is slow)
    assert len(rows) <= 41  # at most four times a second
    assert len(outputs) <= 11
    assert dashboard.record.rows[0].output_lines == 10_000


def test_the_final_state_is_drawn_at_once_and_stays(board):
    dashboard, clock = board
    dashboard.on_event(logged(0, {"loss": 0.5}, 0))
    dashboard.on_event(OutputLine(1, "stdout", "about to fail", False))
    clock.now += 0.01  # within every throttle interval: only the final event draws
    failure = RankFailure(1, 1001, 1, "ValueError", "bad batch", "Traceback ...")
    dashboard.on_event(RankFinished(1, 1, failure, "failed"))
    dashboard.on_event(RankFinished(0, -15, None, "stopped"))
    dashboard.on_event(LaunchFinished("failed", 0.01))
    assert "nl-failed" in dashboard.rows.value and "ValueError: bad batch" in dashboard.rows.value
    assert "nl-stopped" in dashboard.rows.value
    assert "failed after 0.0 s" in dashboard.header.value
    assert "about to fail" in dashboard.outputs[1].value
    # ipywidgets 8 keeps them in .titles, 7 in ._titles: the user sees them either way
    assert titles(dashboard.accordion) == ("Output of 2 ranks (1 line)",)
    assert titles(dashboard.tabs) == ("rank 0 (0)", "rank 1 (1)")
    assert dashboard.accordion.selected_index is None  # collapsed: raw output on demand
    # The lasting record: the final table, the plot and the traceback, as plain HTML.
    record = dashboard.final_html
    assert (
        "ValueError: bad batch" in record
        and "stopped" in record
        and "Traceback of rank 1" in record
    )
    assert svg_width(re.search(r"<svg.*</svg>", record, re.S).group(0)) > 100


def test_the_plot_stays_hidden_until_a_rank_logs(board):
    dashboard, _ = board
    dashboard.on_event(LaunchFinished("ok", 1.0))
    assert dashboard.plot.layout.display == "none" and dashboard.plot_draws == 0
    assert "<svg" not in dashboard.final_html


def test_a_dashboard_failure_warns_once_and_never_ends_the_launch(board, monkeypatch):
    dashboard, clock = board

    def broken(*_):
        raise RuntimeError("frontend gone")

    monkeypatch.setattr("notebook_launcher.widgets.dashboard.render_svg", broken)
    clock.now += 5
    dashboard.on_event(logged(0, {"loss": 0.5}, 0))
    with pytest.warns(
        DashboardWarning,
        match="The launch dashboard stopped updating because of RuntimeError: frontend gone",
    ):
        dashboard.on_event(OutputLine(0, "stdout", "still training", False))
    dashboard.on_event(RankFinished(0, 0, None))
    dashboard.on_event(RankFinished(1, 0, None))
    dashboard.on_event(LaunchFinished("ok", 5.0))
    # The record still reaches its final state, and says why the plot is missing.
    assert (
        dashboard.final_html.count("nl-done") == 2
        and "finished after 5.0 s" in dashboard.final_html
    )
    assert "The plot could not be drawn: RuntimeError: frontend gone" in dashboard.final_html


def test_what_the_throttle_held_back_is_drawn_while_ranks_are_silent(capsys):
    import threading
    import time

    dashboard = WidgetDashboard(tick_s=0.05, show_after_s=0)
    dashboard.on_event(LaunchStarted(1, "fork", "cpu", "no", None))
    dashboard.on_event(RankStarted(0, 1000, "cpu"))
    dashboard.on_event(OutputLine(0, "stdout", "first", False))
    dashboard.on_event(OutputLine(0, "stdout", "then silence", False))  # within the interval
    assert threading.active_count() >= 2
    deadline = time.monotonic() + 30
    while "then silence" not in dashboard.rows.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "then silence" in dashboard.rows.value
    dashboard.on_event(RankFinished(0, 0, None))
    dashboard.on_event(LaunchFinished("ok", 1.0))
    assert not any(t.name == "notebook-launcher-dashboard" for t in threading.enumerate())
    capsys.readouterr()


def test_the_plot_has_one_panel_per_metric_and_grows_with_them():
    one = render_svg(
        {("loss", 0): Curve([0, 1], [1.0, 0.5], 2), ("loss", 1): Curve([0, 1], [1.1, 0.4], 2)}
    )
    three = render_svg(
        {(name, 0): Curve([0, 1], [1.0, 0.5], 2) for name in ("loss", "lr", "accuracy")}
    )
    assert svg_width(three.svg) > 2 * svg_width(one.svg)


def test_a_launch_over_before_its_widgets_are_due_shows_its_record_alone(monkeypatch):
    shown: list[dict] = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, **options: shown.append(bundle))
    clock = Clock()
    dashboard = WidgetDashboard(clock, tick_s=None)
    dashboard.on_event(LaunchStarted(2, "fork", "cpu", "no", None))
    for rank in range(2):
        dashboard.on_event(RankStarted(rank, 1000 + rank, "cpu"))
    dashboard.on_event(logged(0, {"loss": 0.5}, 0))
    clock.now += SHOW_AFTER_S / 2
    for rank in range(2):
        dashboard.on_event(RankFinished(rank, 0, None))
    dashboard.on_event(LaunchFinished("ok", SHOW_AFTER_S / 2))
    assert dashboard.box is None  # no widget was built, none is left to close
    assert dashboard.final_html.count("nl-done") == 2 and "<svg" in dashboard.final_html
    (bundle,) = shown  # displayed once: the record, no widget
    assert bundle["text/html"] == dashboard.final_html and "finished after" in bundle["text/plain"]


def test_the_widgets_appear_with_the_first_event_once_they_are_due(capsys):
    clock = Clock()
    dashboard = WidgetDashboard(clock, tick_s=None)
    dashboard.on_event(LaunchStarted(1, "fork", "cpu", "no", None))
    dashboard.on_event(RankStarted(0, 1000, "cpu"))
    assert dashboard.box is None
    clock.now += SHOW_AFTER_S
    dashboard.on_event(OutputLine(0, "stdout", "epoch 1", False))
    assert dashboard.box is not None and "nl-running" in dashboard.rows.value
    dashboard.on_event(RankFinished(0, 0, None))
    dashboard.on_event(LaunchFinished("ok", SHOW_AFTER_S))
    assert "nl-done" in dashboard.final_html
    capsys.readouterr()


def test_a_large_plot_is_sent_less_often(board, monkeypatch):
    from notebook_launcher.widgets import dashboard as module

    monkeypatch.setattr(module, "PLOT_BYTES_PER_S", 50_000)  # a picture of ~370 kB: one per 7 s
    dashboard, clock = board
    plot = count_changes(dashboard.plot)
    names = [f"metric_{i}" for i in range(24)]
    for step in range(2_000):  # 20 s of a loop logging 100 times a second
        clock.now += 0.01
        dashboard.on_event(
            logged(step % 2, {name: 1 / (step + 1 + i) for i, name in enumerate(names)}, step // 2)
        )
        dashboard.on_event(
            OutputLine(0, "stdout", f"step {step}", False)
        )  # redraws come with events
    assert len(dashboard.plot.value) > 7 * 50_000
    assert 1 <= len(plot) <= 4  # not once a second


def test_a_rank_s_output_panel_shows_its_last_lines_within_a_size(board):
    from notebook_launcher.widgets.html import OUTPUT_CHARS_SHOWN

    dashboard, clock = board
    for i in range(400):
        dashboard.on_event(OutputLine(0, "stdout", f"{i:04d} " + "z" * 1500, False))
    clock.now += 5
    dashboard.on_event(OutputLine(0, "stdout", "the last line", False))
    shown = dashboard.outputs[0].value
    assert "the last line" in shown and "0399 " in shown and "0000 " not in shown
    assert OUTPUT_CHARS_SHOWN - 2000 < len(shown) < OUTPUT_CHARS_SHOWN + 1000
    dashboard.on_event(LaunchFinished("ok", 5.0))
    assert all(not row.output for row in dashboard.record.rows.values())  # let go once finished
