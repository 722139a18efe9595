"""Sessions with real rank processes: state across calls, failures, interrupts, dead ranks, leaks."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import cloudpickle
import pytest

from notebook_launcher import RankFailedError, Session, SessionError
from notebook_launcher.errors import LaunchTypeError
from notebook_launcher.launcher.events import OutputLine
from notebook_launcher.session.protocol import Execute, Push

ALL_REDUCE = "t = torch.ones(8) * (rank + 1)\ntorch.distributed.all_reduce(t)\nt.tolist()"


@pytest.fixture(scope="module")
def session():
    with Session(num_processes=2, hardware="cpu") as running:
        yield running


def wait_until_dead(session: Session, within_s: float = 300.0) -> None:  # a safety net only
    deadline = time.monotonic() + within_s
    while session.alive and time.monotonic() < deadline:
        time.sleep(0.05)


def test_every_rank_starts_with_its_names_and_a_process_group(session):
    values = session.execute(
        "import torch.distributed as dist\n"
        "(rank, local_rank, world_size, str(device), dist.get_rank(), dist.get_backend(), os_env)",
        names={"os_env": None},
    )
    assert values == [(0, 0, 2, "cpu", 0, "gloo", None), (1, 1, 2, "cpu", 1, "gloo", None)]
    assert session.execute("import os\nos.environ['RANK'], os.environ['WORLD_SIZE']") == [
        ("0", "2"),
        ("1", "2"),
    ]


def test_names_stay_on_each_rank_across_three_calls(session):
    assert session.execute("x = rank * 10") == [None, None]
    assert session.execute("x += 1\nx") == [1, 11]
    assert session.execute("x * 2") == [2, 22]
    assert session.execute("x", ranks=[1]) == [11]
    assert session.execute("x", ranks=[1, 0]) == [11, 1]


def test_a_collective_runs_on_every_rank(session):
    assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_run_push_and_pull(session):
    def scaled(factor):
        import torch.distributed as dist

        return dist.get_rank() * factor

    assert session.run(scaled, 5) == [0, 5]
    session.push({"lr": 0.25})
    assert session.pull("lr", rank=1) == 0.25
    session.push({"lr": 0.5}, ranks=[0])
    assert session.execute("lr") == [0.5, 0.25]
    assert "lr" in session.owned_names


def test_output_is_prefixed_with_the_rank(session, capsys):
    session.execute("print('hello from', rank)")
    out = capsys.readouterr().out
    assert "[rank0]: hello from 0\n" in out and "[rank1]: hello from 1\n" in out


def test_a_failing_rank_raises_its_own_error_and_interrupts_the_rank_waiting_in_a_collective(
    session,
):
    session.execute("kept = rank + 100")
    code = "\nif rank == 1:\n    raise ValueError(f'bad batch on rank {rank}')\nt = torch.ones(8)\ntorch.distributed.all_reduce(t)\n"
    with pytest.raises(
        ValueError, match=r"^Rank 1 \(pid \d+\) raised ValueError: bad batch on rank 1\."
    ) as caught:
        session.execute(code, filename="In[12]")
    error = caught.value
    assert isinstance(error, RankFailedError)
    text = str(error)
    assert "Rank(s) 0 were still running the cell and were interrupted." in text
    assert (
        "The process group was rebuilt (a collective may have been left half-done), so the next cell can use collectives again; the names defined so far are kept."
        in text
    )
    assert 'File "In[12]", line 3, in <module>' in text
    assert "raise ValueError(f'bad batch on rank {rank}')" in text
    assert error.failures[0].rank == 1
    # The session goes on, names kept, collectives working again.
    assert session.alive
    assert session.execute("kept") == [100, 101]
    assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_the_stop_button_interrupts_every_rank_and_the_session_survives():
    seen: list[int] = []

    class StopButton:
        """Presses stop (KeyboardInterrupt in the waiting kernel) once both ranks sleep."""

        def on_event(self, event):
            if isinstance(event, OutputLine) and "sleeping" in event.text:
                seen.append(event.rank)
                if len(seen) == 2:
                    raise KeyboardInterrupt

    with Session(num_processes=2, hardware="cpu", observers=[StopButton()]) as session:
        session.execute("y = rank")
        with pytest.raises(
            KeyboardInterrupt,
            match=r"^the cell was interrupted on rank\(s\) 0, 1; the process group was rebuilt; the session "
            r"is ready for the next cell\.\nWhere each rank was when it was stopped:\n"
            # A rank's line reaches the kernel as print() writes it, so the stop may find that
            # rank still returning from print (line 2) rather than asleep (line 3).
            r"rank 0: session cell 2, line (3, in time\.sleep|2, in print)\n"
            r"rank 1: session cell 2, line (3, in time\.sleep|2, in print)$",
        ):
            session.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
        assert session.alive
        assert session.execute("y") == [0, 1]
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_a_hold_on_stop_presses_that_nobody_lets_go_of_ends_with_the_next_call():
    """As in a widget's callback: no cell ends around the call, so nobody releases the hold
    that counts the presses after the first; the next call's stop press must still stop it."""
    seen: list[int] = []

    class StopButton:
        """Presses stop (SIGINT to the kernel's process) once both ranks sleep."""

        def on_event(self, event):
            if isinstance(event, OutputLine) and "sleeping" in event.text:
                seen.append(event.rank)
                if len(seen) % 2 == 0:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sleeping = "import time\nprint('sleeping', flush=True)\ntime.sleep(60)"  # 60: a safety net
    with Session(num_processes=2, hardware="cpu", observers=[StopButton()]) as session:
        session.hold_interrupts = lambda release: None
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt, match=r"^the cell was interrupted on rank"):
                session.execute(sleeping)
        assert session.execute("rank") == [0, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_rank_killed_between_calls_is_noticed_and_named_then_restart_works():
    with Session(num_processes=2, hardware="cpu") as session:
        session.execute("z = 1")
        victim = session.pids[1]
        os.kill(victim, signal.SIGKILL)
        wait_until_dead(session)
        assert not session.alive
        with pytest.raises(
            SessionError,
            match=rf"the session has no usable ranks: Rank 1 \(pid {victim}\) was killed by SIGKILL .*Restart the session \(session.restart\(\), or %distributed restart\)",
        ):
            session.execute("z")
        session.restart()
        assert session.alive
        with pytest.raises(NameError, match="name 'z' is not defined"):
            session.execute("z")
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_a_rank_that_exits_during_a_cell_ends_the_session_with_its_exit_code():
    with Session(num_processes=2, hardware="cpu") as session:
        code = "import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(8)\ntorch.distributed.all_reduce(t)"
        with pytest.raises(
            RankFailedError,
            match=r"Rank 1 \(pid \d+\) exited with code 3 without raising an exception while running the cell; the session's other ranks were stopped",
        ):
            session.execute(code)
        assert not session.alive


def test_two_sessions_work_side_by_side():
    with (
        Session(num_processes=2, hardware="cpu") as first,
        Session(num_processes=2, hardware="cpu") as second,
    ):
        first.execute("who = 'first'")
        second.execute("who = 'second'")
        assert first.execute(ALL_REDUCE) == second.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]
        assert first.execute("who") == ["first", "first"]
        assert second.execute("who") == ["second", "second"]


def test_forkserver_ranks_serve_too():
    with Session(num_processes=2, hardware="cpu", start_method="forkserver") as session:
        assert session.plan.start.method == "forkserver"
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_wrong_arguments_say_what_to_pass(session):
    with pytest.raises(
        LaunchTypeError,
        match=r"ranks=\[2\]: 2 is not a rank of this session, which has ranks 0 to 1\.",
    ):
        session.execute("1", ranks=[2])
    with pytest.raises(
        LaunchTypeError, match=r"ranks=\[0, 0\] must name at least one rank, each once"
    ):
        session.execute("1", ranks=[0, 0])
    with pytest.raises(LaunchTypeError, match=r"push\(\) takes a dict of variable names to values"):
        session.push(["lr"])  # type: ignore[arg-type]
    with pytest.raises(NameError, match=r"name 'nothing_here' is not defined on rank 1"):
        session.pull("nothing_here", rank=1)


def test_a_session_is_listed_for_the_sidebar_and_its_stop_button_ends_it():
    from notebook_launcher import registry

    with Session(num_processes=2, hardware="cpu") as session:
        (record,) = [r for r in registry.list_launches() if r.rank_pids == session.pids]
        assert record.kind == "session" and record.num_processes == 2
        assert registry.request_stop(record.launch_id)
        wait_until_dead(session)
        assert not session.alive
        with pytest.raises(
            SessionError,
            match=r"the session has no usable ranks: it was stopped from the JupyterLab sidebar\. Restart the session",
        ):
            session.execute("1")
        assert all(r.launch_id != record.launch_id for r in registry.list_launches())


class _StopButtonWhen:
    """Presses stop (KeyboardInterrupt in the waiting kernel) once ``count`` lines contain ``text``."""

    def __init__(self, text: str, count: int) -> None:
        self.text, self.count, self.seen = text, count, 0

    def on_event(self, event):
        if isinstance(event, OutputLine) and self.text in event.text:
            self.seen += 1
            if self.seen == self.count:
                raise KeyboardInterrupt


# Rank 0 has issued its collective before it says so (a stop comes after both have spoken),
# and waits in it for rank 1, which never joins.
STUCK_IN_A_COLLECTIVE = (
    "import time\n"
    "if rank == 0:\n    work = torch.distributed.all_reduce(torch.ones(8), async_op=True)\n"
    "    print('waiting', flush=True)\n    work.wait()\n"
    "else:\n    print('waiting', flush=True)\n    time.sleep(600)\n"
)


def test_the_stop_button_also_frees_a_rank_blocked_in_a_collective():
    with Session(
        num_processes=2, hardware="cpu", observers=[_StopButtonWhen("waiting", 2)]
    ) as session:
        with pytest.raises(KeyboardInterrupt, match=r"the cell was interrupted on rank\(s\) 0, 1"):
            session.execute(STUCK_IN_A_COLLECTIVE)
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_a_rank_that_ignores_the_interrupt_is_reported_and_a_second_interrupt_ends_the_session(
    capfd,
):
    import threading

    main = threading.main_thread().ident
    with Session(
        num_processes=2, hardware="cpu", observers=[_StopButtonWhen("deaf", 2)]
    ) as session:

        def second_press() -> None:
            deadline = time.monotonic() + 300  # a safety net only
            while (
                "did not stop within" not in capfd.readouterr().err and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            signal.pthread_kill(main, signal.SIGINT)

        presser = threading.Thread(target=second_press)
        presser.start()
        try:
            with pytest.raises(
                KeyboardInterrupt,
                match=r"^stopped every rank of the session: rank\(s\) 0, 1 did not come back from the interrupt\. Restart the session",
            ):
                session.execute(
                    "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                    "print('deaf', flush=True)\ntime.sleep(600)"
                )
        finally:
            presser.join()
        assert not session.alive
        with pytest.raises(
            SessionError,
            match=r"^the session has no usable ranks: it was stopped from the notebook while rank\(s\) 0, 1 did not come back from an interrupt\. Restart the session",
        ) as caught:
            session.execute("1")
        assert "Rank -1" not in str(caught.value)


def test_restart_of_a_closed_session_and_code_that_is_not_text_say_what_to_do():
    session = Session(num_processes=1, hardware="cpu")
    with pytest.raises(LaunchTypeError, match=r"code must be a string of Python source; got int\."):
        session.execute(42)  # type: ignore[arg-type]
    session.close()
    with pytest.raises(
        SessionError, match=r"restart\(\) was called on a closed session; create a new Session"
    ):
        session.restart()


def test_the_training_core_works_inside_a_session_with_its_precision():
    with Session(num_processes=2, hardware="cpu", mixed_precision="bf16") as session:
        values = session.execute(
            "from notebook_launcher import Accelerator\nacc = Accelerator()\n"
            "(acc.process_index, acc.num_processes, acc.mixed_precision)"
        )
        assert values == [(0, 2, "bf16"), (1, 2, "bf16")]


def test_a_rank_that_segfaults_during_a_cell_is_named_with_its_crash_report():
    with Session(num_processes=2, hardware="cpu") as session:
        with pytest.raises(
            RankFailedError,
            match=r"Rank 1 \(pid \d+\) was killed by SIGSEGV \(segmentation fault\) while running the cell",
        ) as caught:
            session.execute("import ctypes\nif rank == 1:\n    ctypes.string_at(0)\n")
        assert "Fatal Python error: Segmentation fault" in str(caught.value)
        assert not session.alive


STRANGER = r"""
import json, sys
from datetime import timedelta
import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, is_master=False, timeout=timedelta(seconds=10))
keys = store.list_keys()
values = {key: store.get(key).hex() for key in keys}
for key in keys:  # overwrite everything there is
    store.set(key, b"127.0.0.1:1")
    # and what the next generations of the group would read, were the names guessable
    for generation in range(1, 4):
        store.set(key.replace("/0/", f"/{generation}/", 1), b"127.0.0.1:1")
store.set("rank_0", b"127.0.0.1:1")
print(json.dumps({"keys": keys, "values": values}))
"""


def test_a_stranger_on_the_store_port_learns_nothing_and_cannot_break_the_session():
    import json
    import subprocess
    import sys

    with Session(num_processes=2, hardware="cpu") as session:
        session.execute("kept = rank")
        (port,) = set(session.execute("import os\nos.environ['MASTER_PORT']"))
        stranger = subprocess.run(
            [sys.executable, "-c", STRANGER, port],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        seen = json.loads(stranger.stdout)
        assert seen["keys"], "the stranger found no keys at all: nothing was tested"
        for key in seen["keys"]:
            assert len(key) == 64 and all(c in "0123456789abcdef" for c in key), key
        for value in seen["values"].values():
            assert b"127.0.0.1" not in bytes.fromhex(value) and b"cpu" not in bytes.fromhex(value)
        # A failing cell rebuilds the process group from the store: it must still work.
        code = "if rank == 1:\n    raise ValueError('on purpose')\ntorch.distributed.all_reduce(torch.ones(2))"
        for _ in range(2):
            with pytest.raises(
                ValueError, match=r"^Rank 1 \(pid \d+\) raised ValueError: on purpose\."
            ):
                session.execute(code)
        assert session.execute("kept") == [0, 1]
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def _signal_pending(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending & (1 << (signum - 1)))


def _all_threads_stopped(pid: int) -> bool:
    """Whether SIGSTOP has stopped every thread of ``pid`` (it stops them one by one: a
    signal sent before the last stopped may still be taken by a running thread)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/stat") as stat:
            states.append(stat.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in "tT" for state in states)


def test_a_rank_interrupted_before_it_started_the_cell_does_not_run_it():
    # On a busy machine a rank may not have started a cell yet when another rank fails and
    # the kernel interrupts it: the interrupt must still end the cell there, or the rank
    # waits in the cell's all_reduce for a peer that never comes. (Whether the signal finds
    # the rank before its cell starts is a race between its threads: tried a few times.)
    import threading

    code = "if rank == 1:\n    raise ValueError('on purpose')\ntorch.distributed.all_reduce(torch.ones(2))"
    with Session(num_processes=2, hardware="cpu") as session:
        slow = session.pids[0]
        for _ in range(4):
            os.kill(slow, signal.SIGSTOP)  # as if not scheduled yet when the cell is sent
            deadline = time.monotonic() + 120  # a safety net only
            while not _all_threads_stopped(slow) and time.monotonic() < deadline:
                time.sleep(0.01)
            ended = threading.Event()

            def resume_once_interrupted(ended=ended):
                deadline = time.monotonic() + 120  # safety nets only
                while not _signal_pending(slow, signal.SIGINT) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(slow, signal.SIGCONT)
                if not ended.wait(120):
                    os.kill(slow, signal.SIGKILL)  # it ran the cell: it would wait forever

            helper = threading.Thread(target=resume_once_interrupted)
            helper.start()
            try:
                with pytest.raises(
                    ValueError, match=r"^Rank 1 \(pid \d+\) raised ValueError: on purpose\."
                ):
                    session.execute(code)
            finally:
                ended.set()
                helper.join()
        assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]


def test_returned_names_say_their_rank_and_are_cleared_by_the_next_call(session):
    session.execute("ret = rank * 3", returns=["ret"], ranks=[1, 0])
    assert session.returned == {"ret": 3} and session.returned_rank == 1
    session.execute("1")
    assert session.returned == {} and session.returned_rank is None
    session.execute("ret", returns=["ret"])
    session.returned.clear()
    assert session.returned == {}


def test_push_of_a_value_that_cannot_be_pickled_names_it(session):
    import threading

    from notebook_launcher.errors import LaunchConfigError

    with pytest.raises(
        LaunchConfigError,
        match=r"^push\(\) was given the notebook's 'lk' \(a _thread.lock\), which cannot be sent to the ranks: TypeError: .*Create it on the ranks instead",
    ):
        session.push({"lk": threading.Lock()})


def test_a_command_queued_behind_the_one_a_rank_starts_is_run_after_it_not_lost(session):
    # Starting a command, a rank looks at what waits behind it for an interrupt of that
    # command; anything else found there must still run, or its caller waits forever.
    ranks = session._ranks
    first, second = session._counters.next_seq(), session._counters.next_seq()
    pid = session.pids[0]
    os.kill(pid, signal.SIGSTOP)  # both commands wait in the pipe when it reads the first
    try:
        ranks.send(0, Execute(first, "queued = 'ran'", "<queued>", cloudpickle.dumps({})))
        ranks.send(0, Push(second, cloudpickle.dumps({"pushed": "after it"})))
    finally:
        os.kill(pid, signal.SIGCONT)
    ranks.pump(lambda: (0, second) in ranks.replies, timeout=60)  # a safety net
    replies = [ranks.replies.pop((0, seq), None) for seq in (first, second)]
    assert all(reply is not None and reply.failure is None for reply in replies), replies
    assert session.pull("queued") == "ran" and session.pull("pushed") == "after it"


def test_a_ranks_exception_that_cannot_travel_still_brings_its_type(session):
    # The instance holds a lock (it cannot be pickled); its type alone still can, so
    # ``except ValueError`` in the notebook catches the rank's error.
    code = "import threading\nerror = ValueError('holds a lock')\nerror.lock = threading.Lock()\nraise error"
    with pytest.raises(
        ValueError, match=r"^Rank 0 \(pid \d+\) raised ValueError: holds a lock\."
    ) as caught:
        session.execute(code, ranks=[0])
    assert type(caught.value).__name__ == "RankFailedError[ValueError]"
    assert caught.value.__cause__ is None
    assert "line 4, in <module>" in str(caught.value) and "worker.py" not in str(caught.value)


def test_status_from_another_thread_while_a_cell_runs_says_what_and_where(session, tmp_path):
    import threading

    started, go_on = tmp_path / "started", tmp_path / "go-on"
    code = (
        f"import os, time\nopen({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go_on)!r}):\n    time.sleep(0.01)\nrank"
    )
    cell = threading.Thread(target=lambda: session.execute(code, ranks=[1], filename="In[12]"))
    cell.start()
    try:
        deadline = time.monotonic() + 120  # a safety net
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = session.status()
        while rows[1]["where"].startswith("cell 12, line 2") and time.monotonic() < deadline:
            rows = session.status()  # still closing the file it made
    finally:
        go_on.touch()
        cell.join()
    assert rows[0]["state"] == "idle" and rows[0]["running"] is None
    assert rows[1]["running"] == "cell 12" and rows[1]["running_s"] >= 0
    # The side thread reads the main thread wherever it is: in the sleep, or in the check.
    assert rows[1]["where"] in (
        "cell 12, line 4, in time.sleep",
        "cell 12, line 3, in exists",
        "cell 12, line 3, in os.path.exists",
    ), rows[1]
    assert rows[1]["pid"] == session.pids[1] and rows[1]["rss_bytes"] > 10_000_000
    assert rows[1]["cuda_allocated_bytes"] is None and rows[1]["cuda_reserved_bytes"] is None
    with pytest.raises(
        LaunchTypeError, match=r"^timeout=-1 must be a number of seconds above 0, or None\.$"
    ):
        session.execute("1", timeout=-1)


def test_a_kernel_holding_a_thousand_descriptors_can_still_stop_a_rank_in_a_collective():
    # The ranks' own pipes then get numbers past 1024, which select() refuses.
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("this process may not open 1200 descriptors")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with Session(
            num_processes=2, hardware="cpu", observers=[_StopButtonWhen("waiting", 2)]
        ) as session:
            with pytest.raises(KeyboardInterrupt, match=r"interrupted on rank\(s\) 0, 1"):
                session.execute(STUCK_IN_A_COLLECTIVE)
            assert session.execute(ALL_REDUCE) == [[3.0] * 8, [3.0] * 8]
    finally:
        for fd in held:
            os.close(fd)
