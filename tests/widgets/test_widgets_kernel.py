"""The panel and the dashboard in a real Jupyter kernel, seen as a frontend sees them:
comm messages of ipywidgets' models, display data, and what the next launch does."""

from __future__ import annotations

import pytest

from notebook_launcher.widgets.dashboard import ROWS_INTERVAL_S
from tests.support.kernel_driver import CellRun, RunningKernel

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(300)]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Redraws of the rows a rank's change of state forces at once (started, done; a few each).
FORCED_REDRAWS = 10


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    config = tmp_path_factory.mktemp("config")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(config))  # the kernel's defaults file is private
    running = RunningKernel()
    monkeypatch.undo()
    setup = running.run(
        """
        import os, time
        from notebook_launcher import notebook_launcher, configure

        def report():
            print("WORLD_SIZE", os.environ["WORLD_SIZE"], "precision", os.environ["ACCELERATE_MIXED_PRECISION"], flush=True)

        def train(steps):
            from notebook_launcher import Accelerator
            accelerator = Accelerator()
            for step in accelerator.tqdm(range(steps)):
                time.sleep(0.02)
                accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
            print("rank", accelerator.process_index, "finished", flush=True)
        """
    )
    assert setup.error is None, setup.error
    yield running
    running.shutdown()


def opened(cell: CellRun) -> dict[str, dict]:
    """comm id -> initial state, for every ipywidgets model the cell created."""
    return {
        m["content"]["comm_id"]: m["content"]["data"]["state"]
        for m in cell.messages
        if m["msg_type"] == "comm_open" and m["content"]["target_name"] == "jupyter.widget"
    }


def updates(cell: CellRun, comm_id: str) -> list[dict]:
    return [
        m
        for m in cell.messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and m["content"]["data"].get("method") == "update"
    ]


def model_with(models: dict[str, dict], model_name: str, **state: object) -> str:
    found = [
        comm_id
        for comm_id, s in models.items()
        if s["_model_name"] == model_name and all(s.get(k) == v for k, v in state.items())
    ]
    assert len(found) == 1, (model_name, state, found)
    return found[0]


def send_from_frontend(kernel: RunningKernel, comm_id: str, data: dict) -> None:
    """What a widget view sends when the user clicks or picks (ipywidgets' comm protocol)."""
    client = kernel.client
    client.shell_channel.send(client.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def test_configure_shows_a_panel_of_widget_models_with_impossible_choices_disabled(kernel):
    cell = kernel.run("configure()")
    assert cell.error is None, cell.error
    models = opened(cell)
    fp8 = models[model_with(models, "ButtonModel", description="fp8")]
    assert fp8["disabled"] is True and fp8["tooltip"].startswith(
        "fp8 needs a Hopper-class NVIDIA GPU"
    )
    assert models[model_with(models, "ButtonModel", description="bf16")]["disabled"] is False
    shown = [m for m in cell.messages if m["msg_type"] == "display_data"]
    assert len(shown) == 1 and shown[0]["content"]["data"][WIDGET_VIEW]["model_id"] in models


def test_a_choice_made_in_the_panel_drives_the_next_launch(kernel):
    cell = kernel.run("configure()")
    models = opened(cell)
    bf16 = model_with(models, "ButtonModel", description="bf16")
    processes = model_with(models, "DropdownModel")
    one_rank = models[processes]["_options_labels"].index("1")
    send_from_frontend(kernel, bf16, {"method": "custom", "content": {"event": "click"}})
    send_from_frontend(
        kernel, processes, {"method": "update", "state": {"index": one_rank}, "buffer_paths": []}
    )
    try:
        launched = kernel.run("notebook_launcher(report)")
        assert launched.error is None, launched.error
        assert "[rank0]: WORLD_SIZE 1 precision bf16" in launched.stdout
        assert "[rank1]" not in launched.stdout
        explicit = kernel.run(
            "notebook_launcher(report, num_processes=2, mixed_precision='no', dashboard=False)"
        )
        assert "[rank1]: WORLD_SIZE 2 precision no" in explicit.stdout  # arguments still win
    finally:
        kernel.run("from notebook_launcher import defaults; defaults.set_kernel_defaults(None)")


def test_configure_from_code_returns_the_settings_and_shows_nothing(kernel):
    cell = kernel.run("configure(num_processes=2, mixed_precision='bf16')")
    try:
        assert (
            cell.result
            == "LaunchDefaults(num_processes=2, mixed_precision='bf16', start_method=None)"
        )
        assert opened(cell) == {}
        launched = kernel.run("notebook_launcher(report, dashboard=False)")
        assert "[rank1]: WORLD_SIZE 2 precision bf16" in launched.stdout
    finally:
        kernel.run("from notebook_launcher import defaults; defaults.set_kernel_defaults(None)")


def test_a_launch_sends_dashboard_updates_ending_in_every_rank_done_and_a_plot(kernel):
    cell = kernel.run("notebook_launcher(train, args=(25,), num_processes=2)")
    assert cell.error is None, cell.error
    models = opened(cell)
    rows = next(
        i for i, s in models.items() if s["_model_name"] == "HTMLModel" and "<table" in s["value"]
    )
    final_rows = updates(cell, rows)[-1]["content"]["data"]["state"]["value"]
    assert final_rows.count("nl-rank nl-done") == 2
    assert "25/25" in final_rows and "rank 1 finished" in final_rows
    # Throttled: not one message per event, but at most one per ROWS_INTERVAL_S of the
    # launch (plus the redraws each rank's changes of state force), whatever its length.
    sent = updates(cell, rows)
    span_s = (sent[-1]["header"]["date"] - sent[0]["header"]["date"]).total_seconds()
    assert len(sent) <= span_s / ROWS_INTERVAL_S + 1 + FORCED_REDRAWS, (len(sent), span_s)
    # At the end the widgets give way to the lasting record: HTML with the plot as SVG,
    # and its text form for frontends that draw no widgets.
    final = [m for m in cell.messages if m["msg_type"] == "update_display_data"][-1]["content"][
        "data"
    ]
    assert (
        WIDGET_VIEW not in final
        and "<svg" in final["text/html"]
        and "rank 1, loss" in final["text/html"]
    )
    closed = {m["content"]["comm_id"] for m in cell.messages if m["msg_type"] == "comm_close"}
    assert rows in closed
    text = final["text/plain"]
    assert "finished after" in text
    assert [line.split()[:2] for line in text.splitlines()[2:]] == [["0", "done"], ["1", "done"]]
    assert "[rank1]: rank 1 finished" in cell.stdout  # the lines still reach the cell


def test_dashboard_false_sends_no_widget(kernel):
    cell = kernel.run("notebook_launcher(train, args=(3,), num_processes=2, dashboard=False)")
    assert cell.error is None, cell.error
    assert [
        m["msg_type"]
        for m in cell.messages
        if m["msg_type"].startswith(("comm", "display", "update"))
    ] == []
    assert "[rank1]: rank 1 finished" in cell.stdout


def test_without_a_widget_frontend_the_launch_reads_as_text(kernel, tmp_path):
    # This client draws no widgets: it sees the display's text and the cell's stream.
    gate = tmp_path / "gate"
    msg_id = kernel.submit(
        f"""
        def fails():
            if os.environ["RANK"] == "1":
                while not os.path.exists({str(gate)!r}):  # until the test saw the live display
                    time.sleep(0.01)
                raise ValueError("rank 1 gives up")
            time.sleep(30)
        try:
            notebook_launcher(fails, num_processes=2)
        except ValueError:
            print("caught")
        """
    )
    live = kernel.collect(msg_id, until_message="display_data")
    gate.touch()
    cell = kernel.collect(msg_id)
    cell.messages[:0] = live.messages
    assert "caught" in cell.stdout
    texts = [
        m["content"]["data"]["text/plain"]
        for m in cell.messages
        if m["msg_type"] in ("display_data", "update_display_data")
    ]
    assert "running for" in texts[0]
    final = texts[-1].splitlines()
    assert final[0].startswith("notebook_launcher: 2 x cpu ranks, fp32, fork: failed after")
    assert final[2].split()[:2] == ["0", "stopped"]
    assert final[3].split()[:2] == ["1", "failed"] and final[3].endswith(
        "ValueError: rank 1 gives up"
    )


def test_a_huge_line_and_many_lines_reach_the_widgets_cut_and_leave_nothing_held(kernel, tmp_path):
    gate = tmp_path / "gate"
    msg_id = kernel.submit(
        f"""
        def long_lines():
            while not os.path.exists({str(gate)!r}):  # until the live widgets are shown
                time.sleep(0.01)
            for i in range(3000):
                print(f"line {{i}}", flush=True)
            print("x" * 20_000_000, flush=True)  # 20 MB, no line break inside
            print("y" * 3000, flush=True)
        notebook_launcher(long_lines, num_processes=1)
        """
    )
    live = kernel.collect(msg_id, until_message="display_data")
    gate.touch()
    cell = kernel.collect(msg_id)
    cell.messages[:0] = live.messages
    assert cell.error is None, cell.error
    models = opened(cell)
    output = next(
        i for i, s in models.items() if s["_model_name"] == "HTMLModel" and "<pre" in s["value"]
    )
    shown = updates(cell, output)[-1]["content"]["data"]["state"]["value"]
    assert (
        "x" * 2000 + "… (19,998,000 more characters)" in shown
        and "y" * 2000 + "… (1,000 more" in shown
    )
    assert len(shown) < 150_000  # the panel's last lines, not 20 MB
    widget_bytes = sum(
        len(str(m["content"])) for m in cell.messages if m["msg_type"].startswith("comm_")
    )
    assert widget_bytes < 2_000_000
    # The cell's own output has every character; the kernel keeps none of the lines.
    assert "x" * 20_000_000 in cell.stdout
    held = kernel.run(
        "from notebook_launcher.widgets import history\n"
        "print(sum(len(row.output) for row in history._records[-1].rows.values()))"
    )
    assert held.stdout.strip() == "0"
