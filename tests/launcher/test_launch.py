"""Real launches: real rank processes under every start method, on gloo."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from notebook_launcher import (
    LaunchTimeoutError,
    RankFailedError,
    debug_launcher,
    notebook_launcher,
)
from notebook_launcher.launcher import printer
from notebook_launcher.launcher.events import OutputLine, RankFinished, RankMemory
from tests.conftest import run_script
from tests.support.ports import free_port
from tests.support.tiers import fork_quick

METHODS = ["fork", "forkserver", "spawn"]


def all_reduce_ranks(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    result = (dist.get_rank(), dist.get_world_size(), total.item() * scale)
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("method", fork_quick(METHODS))
def test_each_start_method_runs_ranks_that_talk_and_return(method, leak_check):
    assert notebook_launcher(all_reduce_ranks, (10,), num_processes=2, start_method=method) == (
        0,
        2,
        30.0,
    )
    values = notebook_launcher(
        all_reduce_ranks, (1,), num_processes=2, start_method=method, return_all=True
    )
    assert values == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.parametrize("method", fork_quick(METHODS))
def test_lambdas_closures_and_local_classes_travel_by_value(method, leak_check):
    offset = 5

    class Box:
        def __init__(self, value):
            self.value = value

    def make(rank):
        return Box(int(rank) + offset)

    boxes = notebook_launcher(
        lambda: make(os.environ["RANK"]), num_processes=2, start_method=method, return_all=True
    )
    assert [b.value for b in boxes] == [5, 6]
    assert type(boxes[0]).__name__ == "Box"


@pytest.mark.slow(
    reason="a script launched under each start method, spawn and forkserver among them"
)
def test_functions_and_globals_of_a_main_script_work_under_every_start_method(tmp_path):
    out = run_script(
        """
        from notebook_launcher import notebook_launcher
        SCALE = 3
        def helper(x):
            return x * SCALE
        def train(x):
            import os
            return helper(x) + int(os.environ["RANK"])
        # No `if __name__ == "__main__"` guard: ranks must not re-run the script.
        for method in ("fork", "forkserver", "spawn"):
            print(method, notebook_launcher(train, (2,), num_processes=2, start_method=method,
                                            return_all=True, output="none"))
        """,
        tmp_path,
    )
    assert out.splitlines() == ["fork [6, 7]", "forkserver [6, 7]", "spawn [6, 7]"]


def read_contract():
    import torch

    keys = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "ACCELERATE_MIXED_PRECISION",
        "ACCELERATE_USE_CPU",
    ]
    return {k: os.environ.get(k) for k in keys} | {"threads": torch.get_num_threads()}


@pytest.mark.parametrize("method", fork_quick(["fork", "forkserver"]))
def test_every_rank_sees_the_torchrun_contract_and_the_precision(method, leak_check):
    values = notebook_launcher(
        read_contract, num_processes=2, mixed_precision="bf16", start_method=method, return_all=True
    )
    cores = len(os.sched_getaffinity(0))
    for rank, seen in enumerate(values):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["GROUP_RANK"] == "0" and seen["MASTER_ADDR"] == "127.0.0.1"
        assert seen["ACCELERATE_MIXED_PRECISION"] == "bf16" and seen["ACCELERATE_USE_CPU"] == "true"
        assert seen["threads"] == max(1, cores // 2)
    assert values[0]["MASTER_PORT"] == values[1]["MASTER_PORT"]


def test_a_given_port_is_used(leak_check):
    port = free_port()
    assert notebook_launcher(read_contract, num_processes=1, use_port=str(port))[
        "MASTER_PORT"
    ] == str(port)


def test_environment_changes_made_after_the_forkserver_started_reach_the_ranks(
    monkeypatch, leak_check
):
    notebook_launcher(read_contract, num_processes=1, start_method="forkserver")
    monkeypatch.setenv("MY_SETTING", "late")
    got = notebook_launcher(
        lambda: os.environ.get("MY_SETTING"), num_processes=1, start_method="forkserver"
    )
    monkeypatch.undo()
    assert got == "late"


def write_from_c_and_python():
    import ctypes
    import sys

    rank = os.environ["RANK"]
    print(f"python stdout {rank}")
    print(f"python stderr {rank}", file=sys.stderr)
    os.write(1, f"raw fd write {rank}\n".encode())
    libc = ctypes.CDLL(None)
    libc.puts(f"C puts {rank}".encode())
    libc.fflush(None)


def test_output_is_caught_at_descriptor_level_and_prefixed(capfd, leak_check):
    notebook_launcher(write_from_c_and_python, num_processes=2)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        for line in (f"python stdout {rank}", f"raw fd write {rank}", f"C puts {rank}"):
            assert f"[rank{rank}]: {line}\n" in out
        assert f"[rank{rank}]: python stderr {rank}\n" in err


def write_in_fragments(lines):
    rank = os.environ["RANK"]
    for i in range(lines):
        for piece in (f"rank-{rank}-", f"line-{i}-", "end\n"):
            os.write(1, piece.encode())


def test_lines_of_different_ranks_never_merge_and_none_is_lost(capfd, leak_check):
    notebook_launcher(write_in_fragments, (3000,), num_processes=2)
    out, _ = capfd.readouterr()
    lines = out.splitlines()
    assert len(lines) == 6000
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank{rank}]: ")]
        assert mine == [f"[rank{rank}]: rank-{rank}-line-{i}-end" for i in range(3000)]


def print_a_lot(lines):
    import sys

    for i in range(lines):
        sys.stdout.write(f"{i}\n")
    return "done"


def test_a_rank_printing_a_lot_is_never_blocked_and_loses_nothing(capfd, leak_check):
    assert notebook_launcher(print_a_lot, (200_000,), num_processes=1) == "done"
    out, _ = capfd.readouterr()
    assert out.count("\n") == 200_000 and out.endswith("[rank0]: 199999\n")


def show_progress():
    import time

    from tqdm import tqdm

    for _ in tqdm(range(40), mininterval=0, ascii=True):
        time.sleep(0.01)


def test_progress_bars_stay_readable(monkeypatch, capfd, leak_check):
    # One snapshot per interval: an interval longer than the whole launch makes the count
    # independent of how fast this machine draws the forty steps.
    monkeypatch.setattr(printer, "_PROGRESS_INTERVAL_S", 3600.0)
    notebook_launcher(show_progress, num_processes=2)
    _, err = capfd.readouterr()
    for rank in (0, 1):
        mine = [line for line in err.splitlines() if line.startswith(f"[rank{rank}]: ")]
        assert 1 <= len(mine) <= 4, mine  # snapshots, not forty redraws
        assert "100%" in mine[-1] and "40/40" in mine[-1]
        assert "\r" not in "".join(mine)


class DataProblem(Exception):
    pass


def fail_on_rank_one(kind):
    import time

    if os.environ["RANK"] == "1":
        if kind == "value":
            raise ValueError("learning rate 10 is too large")
        if kind == "custom":
            raise DataProblem("shard 3 is empty")
        if kind == "exit":
            os._exit(3)
        if kind == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # rank 0 would wait for rank 1 forever: it must be stopped


class RankOutcomes:
    """How each rank ended, as the launch told its observers; and each rank's lines."""

    def __init__(self) -> None:
        self.states: dict[int, str] = {}
        self.lines: dict[int, list[str]] = {}
        self.all_printed = threading.Event()  # every rank printed at least one line

    def on_event(self, event: object) -> None:
        if isinstance(event, RankFinished):
            self.states[event.rank] = event.state
        elif isinstance(event, OutputLine):
            self.lines.setdefault(event.rank, []).append(event.text)
            if len(self.lines) == 2:
                self.all_printed.set()


@pytest.mark.parametrize("method", fork_quick(["fork", "forkserver"]))
def test_a_failing_rank_raises_its_own_error_and_stops_the_others_at_once(method, leak_check):
    outcomes = RankOutcomes()
    with pytest.raises(ValueError, match="learning rate 10 is too large") as caught:
        notebook_launcher(
            fail_on_rank_one, ("value",), num_processes=2, start_method=method, observers=[outcomes]
        )
    # Rank 0 sleeps a minute: stopped by the launcher, it did not run to its end.
    assert outcomes.states == {0: "stopped", 1: "failed"}
    error = caught.value
    assert isinstance(error, RankFailedError)
    message = str(error)
    assert message.startswith("Rank 1 (pid ")
    assert (
        "raised ValueError: learning rate 10 is too large. The other ranks were stopped." in message
    )
    assert "Traceback from rank 1:" in message and "in fail_on_rank_one" in message
    assert "run_rank" not in message  # the launcher's own frame is not the user's business
    assert [f.rank for f in error.failures] == [1]
    assert isinstance(error.__cause__, ValueError)


@pytest.mark.slow(reason="launches under every start method, spawn among them")
def test_exception_classes_defined_by_the_user_are_kept(leak_check):
    with pytest.raises(DataProblem, match="shard 3 is empty"):
        notebook_launcher(fail_on_rank_one, ("custom",), num_processes=2, start_method="spawn")


def test_a_rank_exiting_non_zero_is_reported_with_its_code(leak_check):
    with pytest.raises(
        RankFailedError, match=r"Rank 1 \(pid \d+\) exited with code 3 without raising an exception"
    ):
        notebook_launcher(fail_on_rank_one, ("exit",), num_processes=2)


def test_a_segfault_is_reported_with_the_signal_and_the_crash_output(leak_check):
    with pytest.raises(
        RankFailedError, match=r"Rank 1 \(pid \d+\) was killed by SIGSEGV \(segmentation fault\)"
    ) as caught:
        notebook_launcher(fail_on_rank_one, ("segfault",), num_processes=2)
    assert "Fatal Python error: Segmentation fault" in str(caught.value)
    assert caught.value.failures[0].signal_name == "SIGSEGV"


def test_a_hung_launch_ends_at_its_timeout_naming_the_ranks(leak_check):
    outcomes = RankOutcomes()
    with pytest.raises(
        LaunchTimeoutError,
        match=r"ran past timeout=1s; rank\(s\) 0, 1 were still running and have been stopped",
    ):
        notebook_launcher(time.sleep, (60,), num_processes=2, timeout=1, observers=[outcomes])
    assert outcomes.states == {0: "stopped", 1: "stopped"}  # not a minute later, at their own end


def unpicklable_result():
    import threading

    return threading.Lock()


def test_a_return_value_that_cannot_come_back_is_explained(leak_check):
    with pytest.raises(
        TypeError, match=r"the return value of rank 0 \(a lock\) cannot be pickled back"
    ):
        notebook_launcher(unpicklable_result, num_processes=1)


def test_rerunning_right_after_a_failure_works_every_time(leak_check):
    for _ in range(4):
        with pytest.raises(ValueError):
            notebook_launcher(fail_on_rank_one, ("value",), num_processes=2)
        assert notebook_launcher(all_reduce_ranks, (1,), num_processes=2) == (0, 2, 3.0)


def own_autogroup():
    """This process's autogroup, None where the scheduler has none; a process in the
    boot-time group (never in a new session since) reads an empty file."""
    if not os.path.exists("/proc/self/autogroup"):
        return None
    with open("/proc/self/autogroup") as file:
        words = file.read().split()
    return words[0] if words else "the boot-time autogroup"


def session_of_rank():
    return os.getpid(), os.getsid(0), os.getpgid(0), own_autogroup()


@pytest.mark.parametrize("method", METHODS)
def test_each_rank_leads_a_session_of_its_own_as_torchruns_workers_do(method, leak_check):
    # Where the CPU scheduler shares time by session (Linux's autogroups), ranks in the
    # kernel's session shared one share between them when the machine was busy.
    seen = notebook_launcher(session_of_rank, num_processes=2, start_method=method, return_all=True)
    for pid, session, group, _ in seen:
        assert session == group == pid
    if seen[0][3] is not None:
        assert len({own_autogroup(), seen[0][3], seen[1][3]}) == 3


def start_a_grandchild():
    import subprocess

    subprocess.Popen(["sleep", "60"])
    return "left a sleeper"


def test_what_a_rank_started_is_stopped_with_it(leak_check):
    assert notebook_launcher(start_a_grandchild, num_processes=2) == "left a sleeper"


def print_then_sleep():
    import time

    print("started", flush=True)
    time.sleep(60)


def test_an_interrupt_stops_every_rank_and_raises_keyboard_interrupt(leak_check):
    main = threading.get_ident()
    outcomes = RankOutcomes()

    def interrupt_once_running():
        if outcomes.all_printed.wait(120):  # both ranks run the function
            signal.pthread_kill(main, signal.SIGINT)  # the stop button

    pusher = threading.Thread(target=interrupt_once_running)
    pusher.start()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(print_then_sleep, num_processes=2, observers=[outcomes])
    pusher.join()
    assert outcomes.states == {0: "stopped", 1: "stopped"}  # not a minute later, at their own end


def test_the_sidebar_can_stop_a_launch(leak_check):
    from notebook_launcher import LaunchStoppedError, registry

    outcomes = RankOutcomes()

    def stop_once_running():
        if not outcomes.all_printed.wait(120):  # both ranks run the function: the launch is listed
            return
        for launch in registry.list_launches():
            if launch.state == "running":
                registry.request_stop(launch.launch_id)

    stopper = threading.Thread(target=stop_once_running)
    stopper.start()
    with pytest.raises(LaunchStoppedError, match="stopped from the JupyterLab sidebar"):
        notebook_launcher(print_then_sleep, num_processes=2, observers=[outcomes])
    stopper.join()
    assert registry.list_launches() == []


def test_auto_falls_back_to_the_forkserver_when_the_kernel_holds_a_process_group(capfd, leak_check):
    import torch.distributed as dist

    from notebook_launcher.rank_env import rank_environment  # noqa: F401  (import before the group)

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert notebook_launcher(all_reduce_ranks, (1,), num_processes=2) == (0, 2, 3.0)
    finally:
        dist.destroy_process_group()
    _, err = capfd.readouterr()
    assert (
        "using start_method='forkserver' because a torch.distributed process group is initialised"
        in err
    )


@pytest.mark.slow(reason="a subprocess that starts a forkserver for its ranks")
def test_auto_falls_back_to_the_forkserver_when_cuda_was_initialised(
    monkeypatch, capfd, leak_check
):
    import torch

    monkeypatch.setattr(
        torch.cuda, "is_initialized", lambda: True
    )  # no GPU here: fake the detection
    assert notebook_launcher(all_reduce_ranks, (1,), num_processes=2) == (0, 2, 3.0)
    _, err = capfd.readouterr()
    assert "using start_method='forkserver' because CUDA was initialised in this kernel" in err


def use_hugging_face_accelerate():
    from accelerate import Accelerator

    accelerator = Accelerator()
    seen = (
        accelerator.num_processes,
        accelerator.process_index,
        accelerator.mixed_precision,
        str(accelerator.device),
        str(accelerator.distributed_type),
    )
    accelerator.wait_for_everyone()
    return seen


def test_hugging_face_accelerate_inside_a_rank_sees_the_launch(leak_check):
    values = notebook_launcher(
        use_hugging_face_accelerate, num_processes=2, mixed_precision="bf16", return_all=True
    )
    assert [v[:3] for v in values] == [(2, 0, "bf16"), (2, 1, "bf16")]
    assert all(v[3].startswith("cpu") for v in values)
    assert values[0][4] == "DistributedType.MULTI_CPU"


def test_debug_launcher_runs_cpu_ranks(leak_check):
    assert debug_launcher(all_reduce_ranks, (1,)) == (0, 2, 3.0)


def log_losses():
    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    for step in range(3):
        # Values that are not floats stay with the trackers: the plot gets the numbers.
        accelerator.log(
            {"loss": (accelerator.process_index + 1) / (step + 1), "note": "text", "huge": 10**400},
            step=step,
        )
    for step in range(3, 20_003):  # a tight loop: its calls travel in batches
        accelerator.log({"lr": 0.5}, step=step)


def test_what_ranks_log_reaches_the_launch_observers(leak_check):
    from notebook_launcher.launcher.events import RankMetrics

    class Collector:
        def __init__(self):
            self.metrics = []
            self.events = 0

        def on_event(self, event):
            if isinstance(event, RankMetrics):
                self.events += 1
                self.metrics += [
                    (event.rank, *call) for call in zip(event.batch.steps, event.batch.calls())
                ]

    collector = Collector()
    notebook_launcher(log_losses, num_processes=2, observers=[collector])
    for rank in range(2):
        calls = [call[1:] for call in collector.metrics if call[0] == rank]  # in the order logged
        assert calls[:3] == [
            (0, {"loss": rank + 1.0}),
            (1, {"loss": (rank + 1) / 2}),
            (2, {"loss": (rank + 1) / 3}),
        ]
        assert calls[3:] == [(step, {"lr": 0.5}) for step in range(3, 20_003)]
    assert collector.events < 20_006 // 10  # not an event per call


def log_odd_steps():
    import torch

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    for step in (lambda: 0, torch.tensor(4), 2.5, "7"):  # a lambda cannot even be pickled
        accelerator.log({"loss": 1.0}, step=step)
    return "done"


def test_a_step_that_is_no_number_is_dropped_and_the_result_still_arrives(leak_check):
    from notebook_launcher.launcher.events import RankMetrics

    steps: dict[int, list[object]] = {0: [], 1: []}

    class Collector:
        def on_event(self, event):
            if isinstance(event, RankMetrics):
                steps[event.rank] += event.batch.steps

    assert (
        notebook_launcher(log_odd_steps, num_processes=2, observers=[Collector()], return_all=True)
        == ["done"] * 2
    )
    assert steps == {0: [None, 4, 2.5, None], 1: [None, 4, 2.5, None]}


def log_beside_a_forked_worker():
    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    worker = os.fork()  # a data loader worker, say: it logs too, at the same time
    for step in range(30_000):
        accelerator.log({f"metric_{i}": float(step) for i in range(8)}, step=step)
    if worker == 0:
        os._exit(0)
    os.waitpid(worker, 0)
    return "done"


def test_a_process_a_rank_forked_never_mixes_its_writes_into_the_ranks(leak_check, capfd):
    from notebook_launcher.launcher.events import RankMetrics

    steps: list[int] = []

    class Collector:
        def on_event(self, event):
            if isinstance(event, RankMetrics):
                steps.extend(event.batch.steps)

    assert (
        notebook_launcher(log_beside_a_forked_worker, num_processes=1, observers=[Collector()])
        == "done"
    )
    assert steps == list(range(30_000))  # the rank's own calls, each once, in order
    # The worker's calls are not sent, and it says so, once (a long launch's closing table
    # may repeat it as the rank's last line).
    said = [
        line
        for line in capfd.readouterr().err.splitlines()
        if line.startswith("[rank0]: ") and "is not sent to the notebook" in line
    ]
    assert len(said) == 1, said


def garble_the_message_pipe():
    from notebook_launcher.launcher import rank

    channel = rank._outbox._channel.fileno()  # what a stray os.write to an inherited fd does
    os.write(channel, len(b"not a pickle").to_bytes(4, "big") + b"not a pickle")
    return "lost"


def test_a_garbled_message_pipe_fails_the_rank_with_a_clear_error(leak_check):
    with pytest.raises(RankFailedError, match=r"Rank 0 .*exited with code 0") as caught:
        notebook_launcher(garble_the_message_pipe, num_processes=1)
    assert "the messages of rank 0 to the notebook could not be read (UnpicklingError" in str(
        caught.value
    )


def hold_memory_until_seen(flag: str) -> bool:
    held = bytearray(96 << 20)  # written: resident, so the peak grows by 96 MB
    deadline = time.monotonic() + 120  # a safety net: the flag comes about a second in
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    del held
    return os.path.exists(flag)


class MemoryWatcher:
    """Creates ``flag`` once every rank sent a reading of its memory holding 96 MB."""

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.seen: set[int] = set()

    def on_event(self, event: object) -> None:
        if isinstance(event, RankMemory) and event.peak_bytes >= 96 << 20:
            self.seen.add(event.rank)
            if len(self.seen) == 2:
                open(self.flag, "w").close()


def test_a_ranks_memory_reaches_the_notebook_while_its_function_still_runs(tmp_path, leak_check):
    # The readings of a running rank are taken by its side thread, about once a second (the
    # final one comes after the function): a rank that holds its memory until the notebook
    # saw a reading returns True.
    flag = str(tmp_path / "seen")
    watcher = MemoryWatcher(flag)
    seen = notebook_launcher(
        hold_memory_until_seen, (flag,), num_processes=2, observers=[watcher], return_all=True
    )
    assert seen == [True, True]


def what_each_fd_is(fds: dict[str, int]) -> dict[str, str]:
    found = {}
    for name, fd in fds.items():
        try:
            found[name] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            found[name] = "closed"
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux lists descriptors in /proc")
def test_a_forked_rank_lets_go_of_the_kernels_sockets_and_event_descriptors_only(
    tmp_path, leak_check
):
    # A kernel holds ZMQ sockets and an event loop's epoll and eventfds; a forked rank must
    # not keep them, but a file or pipe the notebook opened may be what the function reads.
    import select
    import socket

    listener, poller, event = socket.socket(), select.epoll(), os.eventfd(0)
    read_end, write_end = os.pipe()
    data = open(tmp_path / "data.txt", "w")
    fds = {
        "socket": listener.fileno(), "epoll": poller.fileno(), "eventfd": event,
        "pipe": read_end, "file": data.fileno(),
    }  # fmt: skip
    try:
        seen = notebook_launcher(what_each_fd_is, (fds,), num_processes=1, start_method="fork")
    finally:
        listener.close(), poller.close(), data.close()
        for fd in (event, read_end, write_end):
            os.close(fd)
    assert seen["socket"] == seen["epoll"] == seen["eventfd"] == os.devnull
    assert seen["pipe"].startswith("pipe:") and seen["file"] == str(tmp_path / "data.txt")


def test_a_kernel_holding_a_thousand_descriptors_still_hears_from_its_ranks_side_thread(
    tmp_path, leak_check
):
    # The rank's pipes then get numbers past 1024, which select() refuses.
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"this process may open {soft} descriptors")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        flag = str(tmp_path / "seen")
        seen = notebook_launcher(
            hold_memory_until_seen,
            (flag,),
            num_processes=2,
            observers=[MemoryWatcher(flag)],
            return_all=True,
        )
    finally:
        for fd in held:
            os.close(fd)
    assert seen == [True, True]
