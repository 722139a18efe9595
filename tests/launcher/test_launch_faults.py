"""Real launches tried the way a hard user would: each test is one fault that was found."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
import torch

from notebook_launcher import LaunchError, RankFailedError, notebook_launcher, registry
from notebook_launcher.errors import RankInputError
from notebook_launcher.launcher import backends, start_method
from notebook_launcher.launcher.backends.local import LocalBackend
from notebook_launcher.launcher.events import LaunchFinished, LaunchStarted, OutputLine, RankStarted
from tests.conftest import run_script
from tests.support.tiers import fork_quick


def ignore_sigterm_and_wait(marker):
    def note_and_ignore(signum, frame):  # makes the launcher wait its whole grace
        with open(marker, "a") as file:
            file.write("SIGTERM\n")

    signal.signal(signal.SIGTERM, note_and_ignore)
    print("ready", flush=True)
    time.sleep(600)


def stop_twice_once_both_noted_sigterm(function, marker, monkeypatch) -> None:
    """Launch ``function(marker)`` on 2 ranks, press stop once both said "ready", and again
    once both noted SIGTERM in ``marker``: the launch raises KeyboardInterrupt."""
    from notebook_launcher.launcher.rank_group import RankGroup

    # A grace longer than any test: only the second press (or the handlers' run) ends it,
    # however slow this machine is.
    monkeypatch.setitem(RankGroup.__init__.__kwdefaults__, "grace_s", 600.0)
    main = threading.get_ident()
    ready = threading.Event()
    readies: list[int] = []

    class WhenReady:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if isinstance(event, OutputLine) and event.text == "ready":
                readies.append(event.rank)
                if len(readies) == 2:
                    ready.set()

    def press_then_press_again():
        if not ready.wait(120):
            return
        signal.pthread_kill(main, signal.SIGINT)  # the stop button
        deadline = time.monotonic() + 120
        # Both ranks got SIGTERM (and ignore it): the launcher waits in its grace period.
        while time.monotonic() < deadline and not (
            marker.exists() and marker.read_text().count("SIGTERM") == 2
        ):
            time.sleep(0.02)
        signal.pthread_kill(main, signal.SIGINT)  # pressed again: ends the grace

    pusher = threading.Thread(target=press_then_press_again)
    pusher.start()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(
            function, (str(marker),), num_processes=2, timeout=300, observers=[WhenReady()]
        )
    pusher.join()


def test_a_second_interrupt_while_stopping_leaves_nothing_behind(tmp_path, monkeypatch, leak_check):
    marker = tmp_path / "sigterm"
    stop_twice_once_both_noted_sigterm(ignore_sigterm_and_wait, marker, monkeypatch)
    assert marker.read_text() == "SIGTERM\nSIGTERM\n"
    assert registry.list_launches() == []  # and leak_check: no port, thread, fd or process


def sigterm_to_another_thread_and_wait(marker):
    def note_and_ignore(signum, frame):
        with open(marker, "a") as file:
            file.write("SIGTERM\n")

    signal.signal(signal.SIGTERM, note_and_ignore)
    # The kernel then hands the group's SIGTERM to another thread of the rank, as it may
    # whenever the main thread is not the one it picks: CPython trips the handler there,
    # and a main thread asleep would not run it for the whole sleep.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("ready", flush=True)
    time.sleep(600)


def test_a_ranks_sigterm_handler_runs_while_its_main_thread_sleeps(
    tmp_path, monkeypatch, leak_check
):
    marker = tmp_path / "sigterm"
    stop_twice_once_both_noted_sigterm(sigterm_to_another_thread_and_wait, marker, monkeypatch)
    assert marker.exists() and marker.read_text() == "SIGTERM\nSIGTERM\n"


def ask_for_input():
    return input("learning rate? ")


def test_input_in_a_rank_fails_at_once_with_a_clear_message(leak_check):
    with pytest.raises(
        RankInputError,
        match=r"input\(\) \(prompt 'learning rate\? '\) cannot be used in a rank: "
        r"ranks have no terminal or notebook to read from \(their stdin is /dev/null\)\. "
        r"Read the value in the notebook before the launch",
    ) as caught:
        notebook_launcher(ask_for_input, num_processes=1, timeout=60)
    assert isinstance(caught.value, EOFError) and isinstance(caught.value, LaunchError)


def start_a_daemon():

    # Both leave the rank's process group: a new session, and a double fork through a shell.
    own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    forked = subprocess.run(
        "setsid sleep 301 >/dev/null 2>&1 & echo $!",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    )
    return [own_session.pid, int(forked.stdout)]


def daemonize_without_exec():
    # The classic Python daemon: fork, setsid, fork again, never exec a new program.
    reader, writer = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(writer, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.close(writer)
    return int(os.read(reader, 32))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # ended, awaiting init
    except psutil.NoSuchProcess:
        return True


def test_a_daemon_a_rank_started_is_ended_with_the_launch(leak_check):
    pids = notebook_launcher(start_a_daemon, num_processes=1)
    pids.append(notebook_launcher(daemonize_without_exec, num_processes=1, start_method="fork"))
    assert all(gone(pid) for pid in pids), [psutil.Process(p) for p in pids if not gone(p)]


def collective_cut_by_the_stop():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        # Outlives its own SIGTERM: its collective breaks first, when rank 0 ends.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        dist.all_reduce(torch.ones(1))  # rank 0 never joins
    time.sleep(600)


def test_a_rank_whose_collective_a_stopped_peer_cuts_is_stopped_not_failed(leak_check):
    """Ending a launch from outside ends its ranks one by one: a rank whose peer ended first
    sees its collective fail and raises. That is the stop's doing: the launch says it was
    stopped (or timed out), not that the rank failed."""
    from notebook_launcher import LaunchStoppedError

    class StopOnceReady:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if isinstance(event, OutputLine) and event.text == "ready":
                for launch in registry.list_launches():  # the sidebar's stop button
                    registry.request_stop(launch.launch_id)

    states: dict[int, str] = {}

    class States:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if type(event).__name__ == "RankFinished":
                states[event.rank] = event.state

    with pytest.raises(LaunchStoppedError, match="the launch was stopped from the JupyterLab"):
        notebook_launcher(
            collective_cut_by_the_stop,
            num_processes=2,
            timeout=300,
            observers=[StopOnceReady(), States()],
        )
    assert states == {0: "stopped", 1: "stopped"}


def start_a_daemon_then_hang():
    import subprocess

    daemon = subprocess.Popen(["sleep", "302"], start_new_session=True)
    print(f"daemon {daemon.pid}", flush=True)
    time.sleep(120)  # stopped from outside: the rank gets no chance to clean up


def test_a_daemon_of_a_rank_that_was_stopped_is_ended_too(leak_check):
    from notebook_launcher import LaunchStoppedError

    pids: list[int] = []

    class StopOnceTheDaemonRuns:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if isinstance(event, OutputLine) and event.text.startswith("daemon "):
                pids.append(int(event.text.split()[1]))
                for launch in registry.list_launches():  # the sidebar's stop button
                    registry.request_stop(launch.launch_id)

    with pytest.raises(LaunchStoppedError, match="stopped from the JupyterLab sidebar"):
        notebook_launcher(
            start_a_daemon_then_hang, num_processes=1, observers=[StopOnceTheDaemonRuns()]
        )
    assert len(pids) == 1 and gone(pids[0])


class LockedError(ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # cannot be pickled


def raise_locked_error():
    raise LockedError("the shard lock is held")


def test_an_exception_that_cannot_be_pickled_keeps_its_type(leak_check):
    with pytest.raises(LockedError, match="the shard lock is held") as caught:
        notebook_launcher(raise_locked_error, num_processes=1)
    assert isinstance(caught.value, RankFailedError)
    assert "raised tests.launcher.test_launch_faults.LockedError: the shard lock is held" in str(
        caught.value
    )


@pytest.mark.slow(
    reason="a script launched under each start method, spawn and forkserver among them"
)
def test_an_exception_class_of_a_script_keeps_its_type_under_every_start_method(tmp_path):
    out = run_script(
        """
        from notebook_launcher import notebook_launcher
        class ShardError(Exception):
            pass
        def train():
            raise ShardError("shard 3 is empty")
        for method in ("fork", "forkserver", "spawn"):
            try:
                notebook_launcher(train, num_processes=1, start_method=method, output="none")
            except ShardError as error:
                print(method, "caught", isinstance(error, ShardError))
        """,
        tmp_path,
    )
    assert out.splitlines() == ["fork caught True", "forkserver caught True", "spawn caught True"]


def wait_until_reaped(pid: int) -> None:
    """Until ``pid`` is gone even as a zombie: its parent, the launcher, has seen it end."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def leave_early_or_all_reduce():
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        sys.exit(0)
    wait_until_reaped(pids[1])
    dist.all_reduce(torch.ones(1))


def test_a_rank_leaving_early_is_named_as_the_cause(leak_check):
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(leave_early_or_all_reduce, num_processes=2, timeout=120)
    message = str(caught.value)
    assert message.startswith("Rank 0 (pid ")
    assert (
        "Before that, rank 1 (sys.exit(0)) had already exited early, while rank 0 still "
        "needed it: a rank that leaves while the others wait in a collective"
    ) in message
    assert ".;" not in message and ".." not in message


def exit_while_the_other_waits_in_all_reduce():
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 waits in all_reduce meanwhile (or soon: named either way)
        sys.exit(0)
    dist.all_reduce(torch.ones(1))


def test_a_rank_leaving_while_another_waits_is_named_whichever_end_the_kernel_sees_first(
    leak_check,
):
    for _ in range(3):
        with pytest.raises(RankFailedError) as caught:
            notebook_launcher(
                exit_while_the_other_waits_in_all_reduce,
                num_processes=2,
                timeout=120,
                start_method="fork",
            )
        assert (
            "Before that, rank 1 (sys.exit(0)) had already exited early, while rank 0 still needed it"
            in str(caught.value)
        )


def return_at_once_or_look_at_the_peer_that_did():
    from datetime import timedelta

    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        return "returned"
    # Rank 1 marks its return in the store before it waits for this rank's.
    store = dist.distributed_c10d._get_default_store()
    store.wait(["notebook_launcher/returned/1"], timedelta(seconds=120))
    return psutil.Process(pids[1]).status()


def test_a_rank_that_returned_keeps_its_connections_until_its_peers_return(leak_check):
    # Closing them at once would fail a peer still in Gloo's connection handshake.
    status = notebook_launcher(
        return_at_once_or_look_at_the_peer_that_did, num_processes=2, timeout=120
    )
    assert status in ("sleeping", "running", "disk-sleep")  # rank 0's value: rank 1's process


def exit_then_linger_in_the_release_of_the_group():
    import sys

    import torch.distributed as dist

    from notebook_launcher.launcher import rank as rank_process

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:

        def release_then_linger():  # as a busy machine may: the process ends long after
            dist.destroy_process_group()
            time.sleep(600)

        rank_process._release_process_group = release_then_linger  # this rank process's own
        sys.exit(0)
    dist.all_reduce(torch.ones(1))


def test_a_rank_stopped_while_it_exits_after_returning_is_still_named_as_the_cause(leak_check):
    # Its peer fails at once on the closed connection, and the launch stops the lingering
    # rank: what it returned was sent before its connections closed, and still counts.
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(
            exit_then_linger_in_the_release_of_the_group,
            num_processes=2,
            timeout=120,
            start_method="fork",
        )
    message = str(caught.value)
    assert message.startswith("Rank 0 (pid ")
    assert (
        "Before that, rank 1 (sys.exit(0)) had already exited early, while rank 0 still needed it"
        in message
    )
    assert [failure.rank for failure in caught.value.failures] == [0]


def test_a_closed_connection_names_the_rank_that_returned_even_if_its_end_was_seen_later():
    from notebook_launcher.errors import RankFailure
    from notebook_launcher.launcher.channel import Result
    from notebook_launcher.launcher.rank_group import Outcome
    from notebook_launcher.launcher.report import rank_failed_error

    root = RankFailure(
        0,
        11,
        1,
        "RuntimeError",
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
        time=100.0,
    )
    outcome = Outcome(results={1: Result(b"", 0)}, failures=[root], finished_at={1: 100.2})
    assert "Before that, rank 1 (sys.exit(0)) had already exited early" in str(
        rank_failed_error(outcome)
    )
    # A failure of its own (not a closed connection) after a peer returned later: not blamed.
    own = RankFailure(0, 11, 1, "ValueError", "bad batch", time=100.0)
    outcome = Outcome(results={1: Result(b"", None)}, failures=[own], finished_at={1: 100.2})
    assert "Before that" not in str(rank_failed_error(outcome))


def test_a_rank_failing_on_its_own_is_the_cause_even_when_a_peers_closed_connection_came_first():
    from notebook_launcher.errors import RankFailure
    from notebook_launcher.launcher.rank_group import Outcome
    from notebook_launcher.launcher.report import rank_failed_error

    mesh = RankFailure(
        3,
        13,
        1,
        "RuntimeError",
        "Gloo connectFullMesh failed with [pair.cc:144] no error",
        time=100.0,
    )
    own = RankFailure(6, 16, 1, "OSError", "shard 45 is unreadable", time=100.3)
    message = str(rank_failed_error(Outcome(failures=[mesh, own])))
    assert message.startswith("Rank 6 (pid 16) raised OSError: shard 45 is unreadable.")
    assert "Afterwards, rank 3 (pid 13) raised RuntimeError: Gloo connectFullMesh failed" in message
    # Alone, the closed connection is still what is reported.
    assert str(rank_failed_error(Outcome(failures=[mesh]))).startswith(
        "Rank 3 (pid 13) raised RuntimeError"
    )


def test_each_later_failure_is_one_sentence_with_one_full_stop():
    from notebook_launcher.errors import RankFailure
    from notebook_launcher.launcher.rank_group import Outcome
    from notebook_launcher.launcher.report import rank_failed_error

    root = RankFailure(0, 11, 1, "ValueError", "bad batch.", time=100.0)
    later = RankFailure(1, 12, 1, "RuntimeError", "the loader stopped.", time=100.5)
    message = str(rank_failed_error(Outcome(failures=[root, later])))
    assert "Afterwards, rank 1" in message
    assert ".." not in message


def fail_with_a_sentence():
    raise ValueError("the loss is NaN.")


def test_a_message_ending_in_a_full_stop_is_not_punctuated_twice(leak_check):
    with pytest.raises(ValueError) as caught:
        notebook_launcher(fail_with_a_sentence, num_processes=1)
    assert "raised ValueError: the loss is NaN. The other ranks were stopped." in str(caught.value)
    assert ".;" not in str(caught.value) and "NaN.." not in str(caught.value)


class PretendCudaTensor(torch.Tensor):
    """A tensor that says it lives on a GPU (this machine has none)."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)

    def cpu(self):  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


def make_gpu_results():
    weights = torch.ones(2).as_subclass(PretendCudaTensor)
    return {"weights": weights, "loss": 0.5}


@pytest.mark.parametrize("method", fork_quick(["fork", "spawn"]))
def test_returned_tensors_come_back_on_the_cpu_unless_asked_to_keep_them(method, leak_check):
    moved = notebook_launcher(make_gpu_results, num_processes=1, start_method=method)
    assert type(moved["weights"]) is torch.Tensor and moved["weights"].tolist() == [1.0, 1.0]
    kept = notebook_launcher(
        make_gpu_results, num_processes=1, start_method=method, keep_result_devices=True
    )
    assert type(kept["weights"]) is PretendCudaTensor


def test_auto_notices_a_cuda_driver_loaded_by_another_library(monkeypatch, capfd, leak_check):
    # cupy, numba... loaded it
    monkeypatch.setattr(start_method, "library_loaded", lambda soname: soname == "libcuda.so.1")
    assert notebook_launcher(os.getpid, num_processes=1) != os.getpid()
    _, err = capfd.readouterr()
    assert (
        "using start_method='forkserver' because the CUDA driver was initialised in this kernel (libcuda is loaded"
        in err
    )


class Collector:
    def __init__(self, fail_on: type | None = None) -> None:
        self.events: list[object] = []
        self.fail_on = fail_on

    def on_event(self, event: object) -> None:
        self.events.append(event)
        if self.fail_on is not None and isinstance(event, self.fail_on):
            raise RuntimeError("the dashboard broke")


def test_launch_finished_follows_a_rank_that_fails_to_start(monkeypatch, leak_check):
    class NoMoreProcesses(LocalBackend):
        def start(self, plan, specs, ends, payload, target):  # type: ignore[no-untyped-def]
            raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(backends, "lookup", lambda name: NoMoreProcesses())
    seen = Collector()
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        notebook_launcher(os.getpid, num_processes=2, observers=[seen])
    kinds = [type(e) for e in seen.events]
    assert kinds[0] is LaunchStarted and kinds[-1] is LaunchFinished
    assert seen.events[-1].outcome == "error"


def test_launch_finished_follows_an_observer_that_raises(leak_check):
    broken, watching = Collector(fail_on=RankStarted), Collector()
    with pytest.raises(RuntimeError, match="the dashboard broke"):
        notebook_launcher(time.sleep, (30,), num_processes=2, observers=[broken, watching])
    assert (
        isinstance(watching.events[-1], LaunchFinished) and watching.events[-1].outcome == "error"
    )
    assert registry.list_launches() == []


def raise_a_huge_message():
    raise ValueError("e" * 10_000_000)


def test_a_huge_exception_message_is_cut_where_shown_and_kept_whole_in_the_exception(leak_check):
    with pytest.raises(ValueError) as caught:
        notebook_launcher(raise_a_huge_message, num_processes=1)
    shown = str(caught.value)
    assert "ValueError: " + "e" * 2000 + "… (9,998,000 more characters)" in shown
    assert len(shown) < 20_000  # not the message twice over (summary and traceback)
    assert caught.value.__cause__.args[0] == "e" * 10_000_000  # the rank's own exception
    assert caught.value.failures[0].message == "e" * 10_000_000


def free_a_ddp_model_after_destroying_its_group():
    """Thread counts of the rank: the gloo group's worker threads, and those left once the
    group is destroyed and a DDP model, its reducer holding the group, is freed."""
    import gc

    import torch.distributed as dist

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    dist.init_process_group("gloo")
    before = threads()
    group = dist.new_group()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    model(torch.ones(2, 4)).sum().backward()
    with_group = threads()
    dist.destroy_process_group(group)
    del group, model
    gc.collect()
    return with_group - before, threads() - before


def test_a_ddp_model_freed_after_its_group_was_destroyed_does_not_free_the_group(leak_check):
    # Freeing the group from the reducer would join its workers holding the GIL while a worker
    # may still need the GIL to release the last all-reduce: a deadlock inside torch, seen
    # as a rank that hangs at the end of its function. The group is kept until the rank exits.
    started, left = notebook_launcher(
        free_a_ddp_model_after_destroying_its_group,
        num_processes=2,
        timeout=120,  # a safety net: it ends in a second, or hangs for good
    )
    assert started >= 1  # the group's gloo workers
    assert left == started  # none joined: the group was not freed
