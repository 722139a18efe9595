"""A launch ended by its ``timeout=`` or the stop button, in a real kernel, says where each
rank was by the notebook's cell numbers; the record and its drawing say the same."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests.launcher.test_hang_whereabouts import ALL_REDUCE_LINE, HANG, SAY_WHEN, SLEEP_LINE
from tests.support.kernel_driver import RunningKernel, wait_for_output

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel():
    running = RunningKernel()
    try:
        setup = running.run(
            f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from notebook_launcher import notebook_launcher, launches\n" + SAY_WHEN
        )
        assert setup.error is None, setup.error
        yield running
    finally:
        running.shutdown()


def _define(kernel: RunningKernel, source: str) -> int:
    """Run ``source`` as a cell of its own; the cell's number as the notebook shows it."""
    cell = kernel.run(source)
    assert cell.error is None, cell.error
    return next(
        m["content"]["execution_count"] for m in cell.messages if m["msg_type"] == "execute_input"
    )


@pytest.mark.kernel
@pytest.mark.timeout(600)
def test_a_timeout_names_each_ranks_cell_line_and_function_in_the_error_and_the_record(kernel):
    number = _define(kernel, HANG)
    # A name that is markup and a template at once: shown as text everywhere.
    kernel.run("hang.__code__ = hang.__code__.replace(co_name='hang', co_qualname='hang<b>$x</b>')")
    msg_id = kernel.submit("notebook_launcher(hang, num_processes=2, timeout=45, dashboard=True)")
    seen = wait_for_output(kernel, msg_id, ["at sleep", "at all_reduce"])
    cell = kernel.collect(msg_id)
    assert cell.error is not None and cell.error["ename"] == "LaunchTimeoutError", seen
    message = cell.error["evalue"]
    assert re.search(
        r"ran past timeout=45s; rank\(s\) 0, 1 were still running and have been stopped\. "
        r"Where they were:\n"
        rf"  rank 0 was in cell {number}, line {SLEEP_LINE} \(in hang<b>\$x</b>\), in time\.sleep\n"
        rf"  rank 1 was in cell {number}, line {ALL_REDUCE_LINE} \(in hang<b>\$x</b>\), in "
        r"all_reduce \(waiting for the others\)\n"
        r"Raise timeout= if the work needs longer",
        message,
    ), message
    # The record says the same, and its drawing shows the name as text.
    record = kernel.run("print(repr([r['where'] for r in launches()[-1]['ranks']]))")
    where = ast.literal_eval(record.stdout.strip().splitlines()[-1])
    assert where == [
        f"was in cell {number}, line {SLEEP_LINE} (in hang<b>$x</b>), in time.sleep",
        f"was in cell {number}, line {ALL_REDUCE_LINE} (in hang<b>$x</b>), in all_reduce "
        "(waiting for the others)",
    ]
    drawn = [
        m["content"]["data"]["text/html"]
        for m in cell.messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and "text/html" in m["content"]["data"]
    ][-1]
    assert "hang&lt;b&gt;$x&lt;/b&gt;" in drawn and "<b>$x" not in drawn
    assert f"cell {number}, line {ALL_REDUCE_LINE}" in drawn


@pytest.mark.kernel
@pytest.mark.timeout(600)
def test_the_stop_button_names_where_each_rank_was(kernel):
    number = _define(kernel, HANG)
    msg_id = kernel.submit("notebook_launcher(hang, num_processes=2)")
    wait_for_output(kernel, msg_id, ["at sleep", "at all_reduce"])
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
    assert cell.error["evalue"] == (
        "the launch was stopped; every rank has been ended. Where they were:\n"
        f"  rank 0 was in cell {number}, line {SLEEP_LINE} (in hang), in time.sleep\n"
        f"  rank 1 was in cell {number}, line {ALL_REDUCE_LINE} (in hang), in all_reduce "
        "(waiting for the others)"
    )
