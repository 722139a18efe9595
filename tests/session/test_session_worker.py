"""The rank side of a session, piece by piece: running a cell, what travels, the magics' lines."""

from __future__ import annotations

import subprocess
import sys
import traceback

import pytest

from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.session.capture import notebook_values, used_names
from notebook_launcher.session.magics import (
    DistributedUsageError,
    RankValues,
    parse_cell_line,
    parse_line,
)
from notebook_launcher.session.worker import run_cell


def test_a_cell_returns_the_value_of_its_last_expression_and_keeps_its_names():
    namespace: dict = {"rank": 1}
    assert run_cell("x = rank * 10\nx + 1", "<cell 1>", namespace) == 11
    assert namespace["x"] == 10
    assert run_cell("y = x", "<cell 2>", namespace) is None
    assert run_cell("", "<cell 3>", namespace) is None


def test_a_traceback_points_at_the_cells_own_line_and_shows_it():
    code = "a = 1\n\ndef f():\n    raise KeyError('missing')\nf()\n"
    with pytest.raises(KeyError) as caught:
        run_cell(code, "In[7]", {})
    text = "".join(traceback.format_exception(caught.value))
    assert 'File "In[7]", line 4, in f' in text
    assert "raise KeyError('missing')" in text
    assert 'File "In[7]", line 5, in <module>' in text


def test_a_syntax_error_names_the_cell_and_line():
    with pytest.raises(SyntaxError) as caught:
        run_cell("x = 1\nx = (", "In[3]", {})
    assert caught.value.filename == "In[3]" and caught.value.lineno == 2


def test_used_names_include_those_read_inside_functions_and_classes():
    code = "def g():\n    return helper(lr)\nclass M(Base):\n    size = width\nout = g()"
    assert used_names(code) == {"helper", "lr", "Base", "width"}  # g is the cell's own by then


def test_a_name_the_cell_binds_before_reading_it_is_not_the_notebooks():
    assert used_names("gen = 5\ngen") == set()
    assert used_names("x = x + 1") == {"x"}
    assert used_names("for i in range(n):\n    total = total + i") == {"range", "n", "total"}
    assert used_names("def f(a, b=c):\n    d = a\n    return d + e\nf(1)") == {"c", "e"}
    assert used_names("[y for y in z if y > w]") == {"z", "w"}
    assert used_names("if c:\n    v = 1\nelse:\n    v = 2\nv") == {"c"}
    assert used_names("if c:\n    v = 1\nv") == {"c", "v"}  # maybe unbound: the notebook's is sent
    assert used_names("import numpy as np\nnp.zeros(3)") == set()
    assert used_names("try:\n    q = 1\nexcept E as err:\n    print(err)\nq") == {"E", "print", "q"}


def test_an_unpicklable_notebook_value_the_cell_replaces_first_is_not_sent():
    def gen():
        yield 1

    user_ns = {"gen": gen(), "lr": 0.1}
    assert notebook_values("gen = 5\ngen * lr", user_ns) == {"lr": 0.1}


def test_only_notebook_names_the_cell_uses_are_sent_and_owned_names_are_skipped():
    def helper():
        return 1

    user_ns = {"helper": helper, "lr": 0.1, "unused": 5, "In": [], "_private": 1, "x": 3}
    values = notebook_values("helper() + lr + x + In + _private", user_ns, skip={"x"})
    assert values == {"helper": helper, "lr": 0.1}


def test_a_value_that_cannot_travel_is_named_with_what_to_do():
    import threading

    user_ns = {"lock": threading.Lock()}
    with pytest.raises(
        LaunchConfigError,
        match=r"the cell uses the notebook's 'lock' \(a _thread.lock\), which cannot be sent to the ranks: TypeError: .*Create it on the ranks instead",
    ):
        notebook_values("lock.acquire()", user_ns)


def test_magic_lines_parse_into_commands():
    start = parse_line("start -n 2 --precision bf16 --start-method forkserver")
    assert (start.command, start.num_processes, start.precision, start.start_method) == (
        "start",
        2,
        "bf16",
        "forkserver",
    )
    pull = parse_line("pull weights --rank 1")
    assert (pull.command, pull.name, pull.rank) == ("pull", "weights", 1)
    assert parse_line("push a b").names == ["a", "b"]
    for command in ("status", "restart", "stop"):
        assert parse_line(command).command == command
    cell = parse_cell_line("--ranks 0 1 --return loss model")
    assert cell.ranks == [0, 1] and cell.returns == ["loss", "model"]
    assert parse_cell_line("").ranks is None and parse_cell_line("").timeout is None
    assert (
        parse_cell_line("--timeout 2.5").timeout == 2.5 and parse_line("debug --rank 1").rank == 1
    )


def test_a_wrong_magic_line_says_what_is_wrong_without_ending_the_kernel():
    with pytest.raises(
        DistributedUsageError,
        match=r"%distributed needs a command: start, push, pull, show, status, where, debug, auto, restart or stop",
    ):
        parse_line("")
    with pytest.raises(DistributedUsageError, match=r"invalid choice: 'launch'"):
        parse_line("launch")
    with pytest.raises(
        DistributedUsageError, match=r"argument -n/--num-processes: invalid int value: 'two'"
    ):
        parse_line("start -n two")
    with pytest.raises(
        DistributedUsageError, match=r"%%distributed: unrecognized arguments: --rank"
    ):
        parse_cell_line("--rank 1")


def test_each_ranks_value_is_shown_on_its_own_line():
    assert repr(RankValues([0, 1], [1, "a"])) == "[rank0]: 1\n[rank1]: 'a'"
    assert RankValues([1], [5]) == [5]


def test_the_sealed_store_hides_names_and_values_and_refuses_a_forged_value():
    from datetime import timedelta

    import torch.distributed as dist

    from notebook_launcher.launcher.sealed_store import ForgedStoreValue, SealedStore

    inner = dist.HashStore()
    sealed = SealedStore(inner, b"s" * 32, generation=0)
    sealed.set("rank_0", b"127.0.0.1:29500")
    assert sealed.get("rank_0") == b"127.0.0.1:29500"
    sealed.wait(["rank_0"], timedelta(seconds=5))
    assert sealed.add("count", 2) == 2 and sealed.check(["rank_0", "count"])
    (name,) = [key for key in _store_keys(inner) if inner.get(key) != b"2"]
    assert "rank_0" not in name and b"127.0.0.1" not in inner.get(name)
    # Another generation, or another secret, names the same key differently.
    assert not SealedStore(inner, b"s" * 32, generation=1).check(["rank_0"])
    assert not SealedStore(inner, b"t" * 32, generation=0).check(["rank_0"])
    inner.set(name, b"127.0.0.1:1" + b"\0" * 48)
    with pytest.raises(
        ForgedStoreValue,
        match=r"^a rendezvous store value failed its check: a process without the secret of this launch or session wrote it",
    ):
        sealed.get("rank_0")


def _store_keys(store) -> list[str]:
    return list(store.list_keys())


def test_a_status_line_shows_state_pid_memory_cpu_and_cuda_memory_on_gpu_ranks():
    from notebook_launcher.session.protocol import Snapshot
    from notebook_launcher.session.snapshot import status_line, status_row, where_text

    gpu = Snapshot(
        pid=7,
        running="cell 5",
        running_s=72.5,
        where="cell 5, line 2, in step",
        rss_bytes=3 * 2**30,
        cpu_percent=99.6,
        cuda_allocated_bytes=2**30,
        cuda_reserved_bytes=2 * 2**30,
    )
    assert status_line(status_row(1, gpu)) == (
        "rank 1: running cell 5 for 1 min 12 s, pid 7, RSS 3.0 GiB, CPU 100%, CUDA 1.0 GiB allocated, 2.0 GiB reserved"
    )
    cpu = Snapshot(
        pid=8, running=None, running_s=None, where="", rss_bytes=512 * 2**20, cpu_percent=0.0
    )
    assert status_line(status_row(0, cpu)) == "rank 0: idle, pid 8, RSS 512.0 MiB, CPU 0%"
    assert status_line(status_row(2, None)) == "rank 2: not answering"
    assert (
        where_text(1, gpu) == "rank 1: cell 5, line 2, in step"
        and where_text(2, None) == "rank 2: did not answer"
    )


# In a process of its own: it installs the process's SIGINT handler and a watching thread.
_INTERRUPT_WHILE_READING = r"""
import collections, signal, threading
from multiprocessing import Pipe
from notebook_launcher.session.protocol import Execute, Interrupt
from notebook_launcher.session.rank_signals import SignalWatch
from notebook_launcher.session.worker import Worker

class InterruptedWhileReading:
    # The kernel's SIGINT, landing in the middle of reading each message.
    def __init__(self, connection):
        self.connection = connection
    def poll(self):
        return self.connection.poll()
    def recv(self):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return self.connection.recv()

theirs, ours = Pipe()
for message in (Execute(8, "x = 1", "In[2]", b"", ()), Interrupt(7)):
    theirs.send(message)
worker = Worker.__new__(Worker)
worker._commands, worker._waiting = InterruptedWhileReading(ours), collections.deque()
worker.interrupts = SignalWatch(lambda: None, lambda: None)
try:
    with worker.interrupts.running():
        worker._interrupt_queued(8)
except KeyboardInterrupt:
    print("raised after reading:", [type(m).__name__ for m in worker._waiting], ours.poll())
"""


def test_an_interrupt_while_a_rank_reads_its_commands_comes_after_the_message_is_read_whole():
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_WHILE_READING],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # The queued cell is kept for the loop and the pipe holds nothing half read.
    assert done.stdout.strip() == "raised after reading: ['Execute'] False", (
        done.stdout + done.stderr
    )
