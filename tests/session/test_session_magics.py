"""The %distributed magics through a real IPython shell."""

from __future__ import annotations

import pytest
from IPython.testing.globalipapp import start_ipython

from notebook_launcher import RankFailedError, Session, SessionError
from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.session.magics import DistributedMagics, DistributedUsageError


@pytest.fixture(scope="module")
def ip():
    shell = start_ipython()
    shell.run_line_magic("load_ext", "notebook_launcher")
    yield shell
    shell.run_line_magic("distributed", "stop")


def magics(ip) -> DistributedMagics:
    return ip.magics_manager.registry["DistributedMagics"]


def test_a_cell_with_no_session_starts_one_with_the_defaults_and_says_so(ip, capsys):
    ip.run_line_magic("distributed", "stop")
    values = ip.run_cell_magic("distributed", "", "rank * 2")
    assert values == [0, 2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "notebook_launcher: started a session with the default settings (" in err


def test_start_status_and_state_across_cells(ip, capsys):
    ip.run_line_magic("distributed", "start -n 1 --hardware cpu")
    ip.run_line_magic("distributed", "start -n 2 --hardware cpu")
    out = capsys.readouterr().out
    assert "notebook_launcher: session started: 2 CPU ranks" in out
    assert out.strip().splitlines()[-1].endswith("The previous session was stopped.")
    ip.run_cell_magic("distributed", "", "count = rank")
    ip.run_cell_magic("distributed", "", "count += 10")
    assert ip.run_cell_magic("distributed", "", "count") == [10, 11]
    assert repr(ip.run_cell_magic("distributed", "--ranks 1", "count")) == "[rank1]: 11"
    ip.run_line_magic("distributed", "status")
    assert "alive (pids" in capsys.readouterr().out


def test_notebook_functions_classes_and_values_travel_and_return_comes_back(ip):
    ip.run_cell(
        "OFFSET = 7\n"
        "def shift(v):\n    return v + OFFSET\n"
        "class Box:\n    def __init__(self, v):\n        self.v = v\n"
    )
    ip.run_cell_magic("distributed", "--return boxed", "boxed = Box(shift(rank))")
    assert ip.user_ns["boxed"].v == 7  # rank 0's
    ip.run_cell_magic("distributed", "--ranks 1 --return boxed", "boxed = Box(shift(rank))")
    assert ip.user_ns["boxed"].v == 8


def test_a_name_the_ranks_defined_is_not_replaced_by_the_notebooks(ip):
    ip.run_cell_magic("distributed", "", "mine = rank")
    ip.run_cell("mine = 'from the notebook'")
    assert ip.run_cell_magic("distributed", "", "mine") == [0, 1]


def test_push_and_pull(ip):
    ip.run_cell("lr = 0.125")
    ip.run_line_magic("distributed", "push lr")
    ip.run_cell_magic("distributed", "", "scaled = lr * (rank + 1)")
    ip.run_line_magic("distributed", "pull scaled --rank 1")
    assert ip.user_ns["scaled"] == 0.25
    with pytest.raises(
        DistributedUsageError,
        match=r"%distributed push: not_defined_anywhere not defined in the notebook",
    ):
        ip.run_line_magic("distributed", "push not_defined_anywhere")


def test_a_failing_cell_raises_the_ranks_error_with_the_cells_line_numbers(ip):
    with pytest.raises(ZeroDivisionError) as caught:
        # The barrier: rank 0 has ``a`` before rank 1 fails (a rank the failure's interrupt
        # finds before it started the cell does not run it).
        ip.run_cell_magic(
            "distributed", "", "a = 1\ntorch.distributed.barrier()\nb = a / (rank - 1)\n"
        )
    assert isinstance(caught.value, RankFailedError)
    assert str(caught.value).startswith("Rank 1 (pid ")
    assert ", line 4, in <module>" in str(caught.value)  # line 1 is the %%distributed line
    assert ip.run_cell_magic("distributed", "", "a") == [1, 1]


def test_restart_forgets_and_stop_ends(ip, capsys):
    ip.run_cell_magic("distributed", "", "gone = 1")
    ip.run_line_magic("distributed", "restart")
    assert "names defined on the old ranks are gone" in capsys.readouterr().err
    with pytest.raises(NameError):
        ip.run_cell_magic("distributed", "", "gone")
    session = magics(ip).session
    ip.run_line_magic("distributed", "stop")
    assert magics(ip).session is None and session is not None and not session.alive
    with pytest.raises(SessionError, match="the session is closed"):
        session.execute("1")
    with pytest.raises(
        DistributedUsageError, match=r"no session is running; %distributed start -n 2 starts one"
    ):
        ip.run_line_magic("distributed", "pull x")


def test_push_of_a_lock_and_an_unclosed_quote_say_what_is_wrong(ip):
    ip.run_line_magic("distributed", "start -n 2 --hardware cpu")
    ip.run_cell("import threading\nlk = threading.Lock()")
    with pytest.raises(
        LaunchConfigError,
        match=r"^push\(\) was given the notebook's 'lk' \(a _thread.lock\), which cannot be sent to the ranks",
    ):
        ip.run_line_magic("distributed", "push lk")
    with pytest.raises(
        DistributedUsageError,
        match=r"^%distributed start -n 2 'x: No closing quotation; the line is split like a shell command line, so close the quote or escape it\. Usage: %distributed",
    ):
        ip.run_line_magic("distributed", "start -n 2 'x")
    with pytest.raises(
        DistributedUsageError, match=r"^%%distributed --ranks '0: No closing quotation"
    ):
        ip.run_cell_magic("distributed", "--ranks '0", "1")


def test_returned_names_say_which_rank_they_came_from(ip, capsys):
    ip.run_cell_magic("distributed", "--ranks 1 --return who", "who = rank")
    assert ip.user_ns["who"] == 1
    assert "notebook_launcher: who set in the notebook from rank 1.\n" in capsys.readouterr().err


def test_a_cell_magic_inside_a_distributed_cell_is_refused(ip):
    with pytest.raises(
        DistributedUsageError,
        match=r"^%%distributed: the cell uses IPython syntax \(a cell magic such as %%time\), which the ranks cannot run",
    ):
        ip.run_cell_magic("distributed", "", "%%time\nx = 1\ny = 2")


def test_the_magics_session_is_reachable_from_code_for_its_status_and_where(ip):
    ip.run_line_magic("distributed", "start -n 2 --hardware cpu")
    ip.run_cell("from notebook_launcher import Session\nfound = Session.current()")
    found = ip.user_ns["found"]
    assert found is magics(ip).session
    assert [row["rank"] for row in found.status()] == [0, 1]
    assert found.where() == [f"rank {r}: idle, waiting for the next cell" for r in (0, 1)]
    ip.run_line_magic("distributed", "stop")
    with pytest.raises(SessionError, match=r"^no session was started by the magics in this kernel"):
        Session.current()
