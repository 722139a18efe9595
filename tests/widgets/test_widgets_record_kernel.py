"""The lasting record in a real kernel: executed through nbclient, saved, read back and
exported by nbconvert without a kernel; the first rows before any rank process exists."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

import nbformat
import pytest

from tests.support.kernel_driver import RunningKernel, execute_notebook

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(300)]
REPO = pathlib.Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

CELLS = [
    """
    import math, os
    from notebook_launcher import notebook_launcher, launches

    def train(steps):
        from notebook_launcher import Accelerator
        accelerator = Accelerator()
        for step in accelerator.tqdm(range(steps), desc="\\x1b[32mepoch 1\\x1b[0m"):
            loss = 1.0 / (step + 1)
            accelerator.log({"loss": loss, "$\\\\frac$": loss, "<img src=x onerror=alert(1)>": 2.0,
                             "nan_at_3": math.nan if step == 3 else loss, "always_nan": math.nan}, step=step)
        print("\\x1b[31mrank", accelerator.process_index, "done\\x1b[0m", flush=True)
    """,
    "notebook_launcher(train, args=(8,), num_processes=2)",
    """
    def fails(steps):
        from notebook_launcher import Accelerator
        train(steps)
        # Each rank's metrics leave before it waits: none is lost when rank 1's failure
        # stops rank 0 at once.
        Accelerator().wait_for_everyone()
        if os.environ["RANK"] == "1":
            raise ValueError("\\x1b[31mlearning rate too large\\x1b[0m")
    try:
        notebook_launcher(fails, args=(4,), num_processes=2)
    except ValueError as error:
        print("caught", type(error).__name__)
    """,
    "print([(l['outcome'], [r['state'] for r in l['ranks']], sorted(l['metrics'])) for l in launches()])",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    import textwrap

    folder = tmp_path_factory.mktemp("record")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(textwrap.dedent(code)) for code in CELLS]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JUPYTER_RUNTIME_DIR", str(folder / "runtime"))
        env.setenv("JUPYTER_CONFIG_DIR", str(folder / "config"))
        env.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        )
        execute_notebook(notebook, str(folder), timeout=240)
    path = folder / "launch.ipynb"
    nbformat.write(notebook, path)
    return path


def rich_outputs(cell: nbformat.NotebookNode) -> list[dict]:
    return [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")]


def test_a_saved_notebook_keeps_the_record_as_plain_outputs_without_widget_state(saved):
    notebook = nbformat.read(saved, as_version=4)  # as a reopened notebook: no kernel
    text = saved.read_text()
    assert WIDGET_VIEW not in text  # nothing left that would say "model not found"
    (record,) = rich_outputs(notebook.cells[1])
    page = record.data["text/html"]
    assert page.count('class="nl-rank nl-done"') == 2 and page.count(">done<") == 2
    assert "<svg" in page and "step 7, rank 1, loss = 0.125" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img" not in page
    assert "$\\frac$" in page  # the maths-text name is drawn as text, and never froze the record
    assert "all values are NaN" in page and "step 3, rank 0, nan_at_3 = nan" in page
    assert "[31m" not in page and "[32m" not in page
    assert "finished after" in record.data["text/plain"]


def test_a_failed_launch_keeps_the_error_and_traceback_in_its_record(saved):
    notebook = nbformat.read(saved, as_version=4)
    (record,) = rich_outputs(notebook.cells[2])
    page = record.data["text/html"]
    assert "ValueError: learning rate too large" in page and "Traceback of rank 1" in page
    assert "caught RankFailedError" in "".join(o.get("text", "") for o in notebook.cells[2].outputs)
    # The previous launch's curves are drawn faded beside this one's.
    assert "previous launch: rank 0, loss" in page


def test_launches_returns_both_launches_as_plain_data(saved):
    notebook = nbformat.read(saved, as_version=4)
    shown = "".join(o.text for o in notebook.cells[3].outputs if o.output_type == "stream")
    assert shown.startswith(
        "[('ok', ['done', 'done'], ['$\\\\frac$', '<img src=x onerror=alert(1)>'"
    )
    assert "('failed', ['stopped', 'failed']" in shown or "('failed', ['done', 'failed']" in shown


def test_the_tqdm_bar_is_not_repeated_in_the_cells_lines(saved):
    notebook = nbformat.read(saved, as_version=4)
    stderr = "".join(
        o.text
        for o in notebook.cells[1].outputs
        if o.output_type == "stream" and o.name == "stderr"
    )
    assert stderr.count("epoch 1") <= 2  # at most the final state of each rank's bar


def test_nbconvert_html_shows_the_table_and_the_plot_without_a_kernel(saved):
    subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "html", str(saved)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    page = saved.with_suffix(".html").read_text()
    assert page.count('class="nl-record-table"') == 2
    assert "<svg" in page and "step 7, rank 1, loss = 0.125" in page
    assert "ValueError: learning rate too large" in page
    assert "<img src=x onerror" not in page


# A fresh interpreter started from the cell below waits for a file before it runs anything,
# as one does that takes seconds to start and import torch on a busy machine: here the
# forkserver, which must be up before the launcher has any rank process to start.
START_GATE = """
import os, time
gate = os.environ.get("NL_TEST_START_GATE")
while gate and not os.path.exists(gate):
    time.sleep(0.01)
"""
_ROW = re.compile(r'<tr class="nl-rank nl-[\w-]+" data-rank="(\d+)"[^>]*>(.*?)</tr>', re.S)
_CELL = re.compile(r"<td[^>]*>(.*?)</td>", re.S)
_STATE = re.compile(r'class="nl-state"[^>]*>([^<]*)<')


def shown_rows(table: str) -> dict[int, tuple[str, str]]:
    """Each rank's state and elapsed time, as the dashboard's table shows them."""
    rows = {}
    for rank, row in _ROW.findall(table):
        cells = _CELL.findall(row)
        rows[int(rank)] = (_STATE.search(cells[1]).group(1), cells[2])
    return rows


def tables(kernel: RunningKernel, msg_id: str) -> Iterator[dict[int, tuple[str, str]]]:
    """The rows of every table the cell's dashboard draws, in order (its first included)."""
    while True:
        message = kernel.client.get_iopub_msg(timeout=240)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        assert kind != "error", content
        assert kind != "status" or content["execution_state"] != "idle", "the cell ended"
        if kind in ("comm_open", "comm_msg"):
            value = content["data"].get("state", {}).get("value", "")
            if "<table" in value:
                yield shown_rows(value)


def test_rows_show_their_state_and_time_before_any_rank_process_exists(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(START_GATE)
    start_gate, user_gate = tmp_path / "start", tmp_path / "user"
    kernel = RunningKernel()
    try:
        msg_id = kernel.submit(
            f"""
            import os, time
            from notebook_launcher import notebook_launcher
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [{str(tmp_path)!r}, os.environ.get("PYTHONPATH")]))
            os.environ["NL_TEST_START_GATE"] = {str(start_gate)!r}
            def waits():
                while not os.path.exists({str(user_gate)!r}):
                    time.sleep(0.01)
            notebook_launcher(waits, num_processes=2, start_method="forkserver")
            """
        )
        shown = tables(kernel, msg_id)
        # No rank process can exist yet: every row is there, starting, with its time moving on.
        first = next(shown)
        assert sorted(first) == [0, 1] and {state for state, _ in first.values()} == {"starting"}
        assert all(elapsed.endswith(" s") for _, elapsed in first.values()), first
        for rows in shown:
            assert {state for state, _ in rows.values()} == {"starting"}, rows
            if rows != first:
                break  # a redraw: the time moved on
        start_gate.touch()
        # The ranks run, blocked in the function until the test has seen them running.
        for rows in shown:
            if {state for state, _ in rows.values()} == {"running"}:
                break
        assert all(elapsed.endswith(" s") for _, elapsed in rows.values()), rows
        user_gate.touch()
        cell = kernel.collect(msg_id)
        assert cell.error is None, cell.error
    finally:
        start_gate.touch()
        user_gate.touch()
        kernel.shutdown()


def test_a_stopped_launch_ends_its_traceback_with_one_short_line():
    kernel = RunningKernel()
    try:
        msg_id = kernel.submit(
            """
            import time
            from notebook_launcher import notebook_launcher
            def waits():
                print("ready", flush=True)
                time.sleep(300)
            notebook_launcher(waits, num_processes=2)
            """
        )
        kernel.collect(msg_id, until="ready")
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id)
        assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
        traceback = "\n".join(cell.error["traceback"])
        assert "selectors.py" not in traceback and "During handling" not in traceback
        assert cell.error["evalue"].startswith(
            "the launch was stopped; every rank has been ended. Where they were:\n  rank 0 was in "
        )
        # The record says so too.
        final = [m for m in cell.messages if m["msg_type"] == "update_display_data"][-1]["content"][
            "data"
        ]
        assert (
            "was interrupted after" in final["text/html"]
            and final["text/html"].count("nl-stopped") == 2
        )
    finally:
        kernel.shutdown()
