"""Where each rank is stuck, its status, and pdb in a failed rank, in a real Jupyter kernel."""

from __future__ import annotations

import base64
import re
import time

import pytest

from notebook_launcher import registry
from tests.support.kernel_driver import (
    CellRun,
    RunningKernel,
    run_ok,
    wait_for_output,
    with_session,
)

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel():
    yield from with_session()


def next_cell_number(kernel: RunningKernel) -> int:
    """The number the notebook shows on the next cell (``In [n]``), as tracebacks name it."""
    shown = [
        m["content"]["execution_count"]
        for m in run_ok(kernel, "pass").messages
        if m["msg_type"] == "execute_input"
    ]
    return shown[0] + 1


def run_answering(
    kernel: RunningKernel, code: str, answers: list[str]
) -> tuple[CellRun, list[str]]:
    """Run a cell that asks for input (Jupyter's stdin channel), typing ``answers`` in turn."""
    msg_id = kernel.client.execute(code, allow_stdin=True)
    prompts = []
    for answer in answers:
        request = kernel.client.get_stdin_msg(timeout=120)  # a safety net
        assert request["msg_type"] == "input_request", request
        prompts.append(request["content"]["prompt"])
        kernel.client.input(answer)
    return kernel.collect(msg_id), prompts


def test_debug_with_no_failed_cell_says_there_is_nothing_to_debug(kernel):
    cell = kernel.run("%distributed debug")
    assert cell.error["ename"] == "SessionError"
    assert cell.error["evalue"] == (
        "no cell has failed on the ranks of this session, so there is no error to debug; after a "
        "cell fails, %distributed debug (or session.debug(rank=R)) opens pdb where it failed."
    )


def test_a_cell_past_its_timeout_names_each_ranks_line_one_in_sleep_one_blocked_in_all_reduce(
    kernel,
):
    n = next_cell_number(kernel)
    cell = kernel.run(
        "%%distributed --timeout 3\n"
        "import time\n"
        "t = torch.ones(2)\n"
        "if rank == 0:\n"
        "    time.sleep(600)\n"
        "torch.distributed.all_reduce(t)\n"
    )
    assert cell.error["ename"] == "SessionTimeoutError"
    assert cell.error["evalue"].startswith(
        "the cell ran past its timeout of 3s and was interrupted on rank(s) 0, 1; the process "
        "group was rebuilt; the session is ready for the next cell.\nWhere each rank was when it "
        f"was stopped:\nrank 0: cell {n}, line 5, in time.sleep\n"
        f"rank 1: cell {n}, line 6, in all_reduce (waiting for the others)"
    ), cell.error["evalue"]
    after = run_ok(
        kernel, "%%distributed\nt = torch.ones(2)\ntorch.distributed.all_reduce(t)\nt.tolist()"
    )
    assert after.result == "[rank0]: [2.0, 2.0]\n[rank1]: [2.0, 2.0]"


def where_the_sidebar_is_told(kernel: RunningKernel) -> list[str]:
    """Ask the kernel's session where its ranks are, as the server does, and read the answer
    from its record once it is there."""
    (record,) = [
        r for r in registry.list_launches() if r.kernel_pid == kernel.pid and r.kind == "session"
    ]
    assert record.where_at is None or record.where
    asked_after = record.where_at
    assert registry.request_where(record.launch_id)
    deadline = time.monotonic() + 120  # a safety net: the watcher answers within a second
    while time.monotonic() < deadline:
        (record,) = [r for r in registry.list_launches() if r.launch_id == record.launch_id]
        if record.where_at != asked_after:
            return record.where
        time.sleep(0.05)
    raise AssertionError("the session did not answer where its ranks are")


def test_the_stop_button_names_where_each_rank_was_inside_a_function_of_the_cell(kernel):
    n = next_cell_number(kernel)
    msg_id = kernel.submit(
        "%%distributed\n"
        "import time\n"
        "def wait():\n"
        "    time.sleep(600)\n"
        "print('waiting', flush=True)\n"
        "if rank == 0:\n"
        "    time.sleep(600)\n"
        "wait()\n"
    )
    wait_for_output(kernel, msg_id, ["[rank0]: waiting", "[rank1]: waiting"])
    # The sidebar asks too, while the cell runs (through the record it lists).
    assert where_the_sidebar_is_told(kernel) == [
        f"rank 0: cell {n}, line 7, in time.sleep",
        f"rank 1: cell {n}, line 4 (in wait), in time.sleep",
    ]
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=600)  # a safety net: it ends in seconds
    assert cell.error["ename"] == "KeyboardInterrupt"
    assert "Where each rank was when it was stopped:\n" in cell.error["evalue"]
    assert f"\nrank 0: cell {n}, line 7, in time.sleep" in cell.error["evalue"], cell.error[
        "evalue"
    ]
    assert f"\nrank 1: cell {n}, line 4 (in wait), in time.sleep" in cell.error["evalue"]


def test_where_and_status_show_every_rank_with_its_memory(kernel):
    assert run_ok(kernel, "%distributed where").stdout == (
        "rank 0: idle, waiting for the next cell\nrank 1: idle, waiting for the next cell\n"
    )
    run_ok(
        kernel, "%%distributed\nbig = torch.ones(60_000_000) if rank == 1 else None"
    )  # 240 MB on rank 1
    lines = run_ok(kernel, "%distributed status").stdout.splitlines()
    assert lines[0].startswith("notebook_launcher: 2 CPU ranks") and "alive (pids " in lines[0]
    pids = [int(p) for p in lines[0].split("(pids ")[1].rstrip(")").split(", ")]
    rss = []
    for rank, line in enumerate(lines[1:]):
        found = re.fullmatch(
            rf"rank {rank}: idle, pid {pids[rank]}, RSS ([\d.]+) MiB, CPU \d+%", line
        )
        assert found, line
        rss.append(float(found.group(1)))
    assert rss[1] - rss[0] > 200, rss
    run_ok(kernel, "%%distributed\ndel big")


def test_pdb_in_the_failed_rank_through_the_input_box_then_the_session_goes_on(kernel):
    n = next_cell_number(kernel)
    failed = kernel.run(
        "%%distributed\n"
        "x = 41 + rank\n"
        "torch.distributed.barrier()  # rank 0 has x before rank 1 fails\n"
        "def inner(y):\n"
        "    z = y * 2\n"
        "    raise ValueError(z)\n"
        "if rank == 1:\n"
        "    inner(x)\n"
    )
    assert failed.error["ename"] == "RankFailedError[ValueError]"
    cell, prompts = run_answering(kernel, "%distributed debug", ["p z", "up", "p x", "l", "q"])
    assert cell.error is None, cell.error
    assert prompts == ["(Pdb) "] * 5
    assert cell.stdout.startswith(
        f"pdb in rank 1, at the error of cell {n} (q quits; the other ranks wait).\n"
        f"> In[{n}](6)inner()\n-> raise ValueError(z)\n84\n> In[{n}](8)<module>()\n-> inner(x)\n42\n"
    ), cell.stdout
    assert "  8  ->\t    inner(x)\n" in cell.stdout
    # The other rank kept its names; the failure is gone once the next cell ran.
    assert run_ok(kernel, "%%distributed\nx").result == "[rank0]: 41\n[rank1]: 42"
    again = kernel.run("%distributed debug --rank 1")
    assert again.error["ename"] == "SessionError"
    assert again.error["evalue"] == (
        f"rank 1 has no error to debug: the last cell it ran (cell {n + 2}) did not fail there. A "
        "rank keeps its error for %distributed debug until the next cell runs."
    )


def shell_reply(kernel: RunningKernel, msg_id: str) -> dict:
    """The content of the kernel's reply to request ``msg_id`` (earlier replies are skipped)."""
    while True:
        message = kernel.client.get_shell_msg(timeout=120)  # a safety net
        if message["parent_header"].get("msg_id") == msg_id:
            return message["content"]


def test_tab_and_shift_tab_answer_from_the_ranks_without_touching_the_kernels_names(kernel):
    run_ok(
        kernel,
        "%%distributed\nonly_on_ranks = rank\nif rank == 1:\n    rank_one_thing = 3\n"
        "def scale(x, factor=2):\n    'Multiply x by factor.'\n    return x * factor",
    )
    for code, expected in (
        ("%%distributed\nonly_on", ["only_on_ranks"]),
        ("%%distributed\nrank_o", ["rank_one_thing"]),
    ):
        reply = shell_reply(kernel, kernel.client.complete(code, len(code)))
        assert reply["matches"] == expected and reply["cursor_start"] == code.index("\n") + 1, reply
    types = {c["text"]: c["type"] for c in reply["metadata"]["_jupyter_types_experimental"]}
    from IPython.core import completer  # the kernel's IPython is this environment's

    if hasattr(completer, "context_matcher"):
        assert types == {"rank_one_thing": "int, rank 1 only"}
    else:  # IPython before 8.6: a matcher returns names without their types
        assert list(types) == ["rank_one_thing"]
    code = "%%distributed\nscale(3)"
    reply = shell_reply(kernel, kernel.client.inspect(code, code.index("scale") + 2))
    assert reply["found"] is True
    assert reply["data"]["text/plain"].startswith(
        "Type:      function\nSignature: scale(x, factor=2)\nDocstring: Multiply x by factor."
    ), reply
    # Not a rank cell: the kernel's own names, where there is no scale.
    assert shell_reply(kernel, kernel.client.inspect("scale(3)", 2))["found"] is False
    names = run_ok(
        kernel, "[n for n in ('only_on_ranks', 'rank_one_thing', 'scale') if n in globals()]"
    )
    assert names.result == "[]"


def test_auto_mode_runs_every_cell_on_the_ranks_until_off_and_local_cells_in_the_kernel(kernel):
    on = run_ok(kernel, "%distributed auto on")
    assert "every cell now runs on the ranks" in on.stdout
    cell = run_ok(kernel, "rank * 10")
    assert cell.result == "[rank0]: 0\n[rank1]: 10"
    assert "[on the ranks] (auto mode; %%local runs a cell here)" in cell.stderr
    assert run_ok(kernel, "%%local\nimport os\nos.getpid()").result == str(kernel.pid)
    failed = kernel.run("x = 1\nraise ValueError('line two')")
    assert failed.error["ename"] == "RankFailedError[ValueError]"
    assert ", line 2, in <module>" in failed.error["evalue"]  # the cell's own numbering
    run_ok(kernel, "%distributed auto off")
    assert kernel.run("rank").error["ename"] == "NameError"
    assert run_ok(kernel, "%%distributed\nrank").result == "[rank0]: 0\n[rank1]: 1"


def test_html_a_figure_and_display_from_each_rank_show_as_rich_output_labelled_with_the_rank(
    kernel,
):
    cell = run_ok(
        kernel,
        "%%distributed\n"
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import HTML, Markdown\n"
        "display(HTML(f'<b>rank {rank}</b><img src=x onerror=alert(1)>'))\n"
        "display(Markdown(f'*{rank}*'))\n"
        "line, = plt.plot([0, rank + 1])  # left open: shown when the cell ends\n",
    )
    shown = [m["content"] for m in cell.messages if m["msg_type"] == "display_data"]
    labels = [c["data"] for c in shown if c["data"].get("text/plain", "").startswith("[rank")]
    assert sorted(d["text/plain"] for d in labels) == ["[rank0]:"] * 3 + ["[rank1]:"] * 3
    assert all(set(d) == {"text/plain"} for d in labels)  # a label is plain text only
    rich = [c for c in shown if c["data"] not in labels]
    by_rank = {
        r: [c["data"] for c in rich if c["metadata"]["notebook_launcher"]["rank"] == r]
        for r in (0, 1)
    }
    for rank, bundles in by_rank.items():
        assert (
            bundles[0]["text/html"] == f"<b>rank {rank}</b><img src=x onerror=alert(1)>"
        )  # as sent
        assert bundles[1]["text/markdown"] == f"*{rank}*"
        assert base64.b64decode(bundles[2]["image/png"]).startswith(b"\x89PNG")
    shown_now = run_ok(kernel, "%%distributed\nimport matplotlib.pyplot as plt\nplt.get_fignums()")
    assert shown_now.result == "[rank0]: []\n[rank1]: []"  # shown figures are closed


def test_tqdm_bars_from_each_rank_show_as_bars_that_update_in_place(kernel):
    cell = run_ok(
        kernel,
        "%%distributed\n"
        "import tqdm\n"
        "from tqdm.auto import tqdm as auto_bar\n"
        "for _ in auto_bar(range(3), desc='<img src=x onerror=alert(1)>'):\n"
        "    pass\n"
        "for _ in tqdm.tqdm(range(4), desc='plain'):\n"
        "    pass\n",
    )
    shown = [
        m["content"]
        for m in cell.messages
        if m["msg_type"] in ("display_data", "update_display_data")
    ]
    assert all(
        "application/vnd.jupyter.widget-view+json" not in c["data"] for c in shown
    )  # no widget
    last = {c["transient"]["display_id"]: c["data"] for c in shown}  # each bar's final state
    assert len(last) == 4, shown
    finals = sorted(data["text/html"] for data in last.values())
    for rank in (0, 1):
        escaped = f"<b>rank {rank} · &lt;img src=x onerror=alert(1)&gt;</b>"
        assert [h for h in finals if escaped in h and "100% 3/3" in h], finals
        assert [h for h in finals if f"<b>rank {rank} · plain</b>" in h and "100% 4/4" in h], finals
    assert "plain: 100%" not in cell.stderr  # drawn as a bar, not printed again
    assert sorted(data["text/plain"][:18] for data in last.values()) == (
        ["[rank0]: <img src=", "[rank0]: plain: 10", "[rank1]: <img src=", "[rank1]: plain: 10"]
    )


def test_display_from_ranks_started_afresh_shows_as_rich_output(kernel):
    run_ok(kernel, "%distributed stop\n%distributed start -n 2 --hardware cpu --start-method spawn")
    try:
        cell = run_ok(
            kernel,
            "%%distributed\n"
            "from IPython.display import HTML, display\n"
            "display(HTML(f'<b>from {rank}</b>'))\n",
        )
    finally:
        run_ok(kernel, "%distributed stop\n%distributed start -n 2 --hardware cpu")
    shown = [m["content"]["data"] for m in cell.messages if m["msg_type"] == "display_data"]
    assert sorted(d["text/html"] for d in shown if "text/html" in d) == [
        "<b>from 0</b>",
        "<b>from 1</b>",
    ]
    assert "IPython.core.display.HTML object" not in cell.stdout
