"""backend="ray": ranks as Ray actors on a local cluster, kept on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from notebook_launcher import LaunchConfigError, RankFailedError, notebook_launcher  # noqa: E402
from notebook_launcher.errors import LaunchUnsupportedError  # noqa: E402
from notebook_launcher.launcher.backends import ray_local  # noqa: E402
from notebook_launcher.launcher.events import OutputLine  # noqa: E402
from tests.support.ray_cluster import LoopbackRayCluster, favour  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow(reason="a Ray actor per rank per launch; beside the other tests, minutes"),
]

# Multi-node clusters off: Ray keeps the node address 127.0.0.1 and binds loopback alone.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """One single-node cluster for the module (2 CPUs, loopback), which this process joins
    as a kernel joins a user's cluster. tests/support/ray_cluster.py starts it with every port of
    Ray's agents given, so a busy machine cannot time out its raylet's wait for them."""
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)
    # Ray reads its settings from the environment when imported; this re-reads them.
    ray._raylet.Config.initialize("")
    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")  # Ray's socket paths: under 107 bytes
    home = tempfile.mkdtemp(prefix="h", dir="/tmp")
    running = LoopbackRayCluster(temp_dir, home)
    favour(os.getpid())  # the driver of the module's launches, until the module ends
    try:
        running.add_node(num_cpus=2)
        # Ray's connect has no deadline (and holds the main thread in C++, out of pytest's
        # timeout's reach); beside two busy loops it was once seen waiting for good. Past a
        # safety net the cluster is stopped, and should that not end it, this worker ends.
        connected = threading.Event()

        def watchdog() -> None:
            if not connected.wait(600):
                running.stop()
                if not connected.wait(120):
                    os._exit(70)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            # This process imported Ray before the environment above: switched as the launcher does.
            with ray_local._single_node(loopback=True):
                ray.init(address=running.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        finally:
            connected.set()
        yield ray
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        running.stop()
        favour(os.getpid(), 0)
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def alive_actors() -> list[str]:
    from ray._private import state

    return [a["ActorID"] for a in state.actors().values() if a["State"] != "DEAD"]


@pytest.fixture
def no_actor_left(cluster):
    yield
    deadline = time.monotonic() + 30
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_actors() == []
    assert not [t for t in threading.enumerate() if t.name == "notebook_launcher-ray-feed"]


def all_reduce_and_talk(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} on stdout")
    print(f"rank {dist.get_rank()} on stderr", file=sys.stderr)
    os.system(f"echo rank {dist.get_rank()} from a child process")  # fd-level output
    return dist.get_rank(), total.item() * scale


def test_ray_ranks_return_values_and_stream_their_output(capfd, no_actor_left):
    values = notebook_launcher(
        all_reduce_and_talk, (10,), num_processes=2, backend="ray", return_all=True
    )
    assert values == [(0, 30.0), (1, 30.0)]
    assert notebook_launcher(all_reduce_and_talk, (1,), num_processes=2, backend="ray") == (0, 3.0)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert out.count(f"[rank{rank}]: rank {rank} of 2 on stdout\n") == 2
        assert out.count(f"[rank{rank}]: rank {rank} from a child process\n") == 2
        assert err.count(f"[rank{rank}]: rank {rank} on stderr\n") == 2


def test_many_lines_arrive_whole_and_in_order(capfd, no_actor_left):
    def chatty():
        rank = os.environ["RANK"]
        for i in range(2000):
            print(f"line {i} of rank {rank} " + "x" * 50)

    notebook_launcher(chatty, num_processes=2, backend="ray")
    out = capfd.readouterr().out
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank{rank}]: ")]
        assert lines == [f"[rank{rank}]: line {i} of rank {rank} " + "x" * 50 for i in range(2000)]


def fails_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("no such column: 'label'")
    time.sleep(120)


def test_a_failing_ray_rank_is_named_with_its_traceback_and_type(no_actor_left):
    with pytest.raises(KeyError) as caught:
        notebook_launcher(fails_on_rank_1, num_processes=2, backend="ray", output="none")
    error = caught.value
    assert isinstance(error, RankFailedError)
    assert str(error).startswith("Rank 1 (pid ")
    assert "raised KeyError: \"no such column: 'label'\". The other ranks were stopped." in str(
        error
    )
    assert "Traceback from rank 1:" in str(error)
    assert "in fails_on_rank_1\n    raise KeyError(\"no such column: 'label'\")" in str(error)
    assert [f.rank for f in error.failures] == [1]  # rank 0 was stopped: it did not fail


class InterruptWhenBothStarted:
    """Presses the stop button (SIGINT to the calling thread) once both ranks run."""

    def __init__(self) -> None:
        self.started: set[int] = set()
        self.main = threading.get_ident()
        self.pressed: list[str] = []  # the thread that pressed, and the handler it met

    def on_event(self, event):
        if isinstance(event, OutputLine) and event.text == "started":
            self.started.add(event.rank)
            if self.started == {0, 1}:
                self.pressed.append(
                    f"{threading.current_thread().name}: {signal.getsignal(signal.SIGINT)!r}"
                )
                signal.pthread_kill(self.main, signal.SIGINT)


def print_then_sleep():
    print("started", flush=True)
    time.sleep(120)


def test_an_interrupt_stops_every_ray_rank(no_actor_left):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # no earlier test's left
    press = InterruptWhenBothStarted()
    try:
        notebook_launcher(print_then_sleep, num_processes=2, backend="ray", observers=[press])
    except KeyboardInterrupt:
        return
    raise AssertionError(f"the launch ended without the interrupt; pressed: {press.pressed}")


class KillActorOfRank1:
    """Kills rank 1's actor (the Ray worker that forked it) from outside, once it waits."""

    def on_event(self, event):
        if (
            isinstance(event, OutputLine)
            and event.rank == 1
            and event.text.startswith("waiting under ")
        ):
            os.kill(int(event.text.split()[-1]), signal.SIGKILL)


def print_parent_then_wait():
    print(f"waiting under {os.getppid()}", flush=True)
    time.sleep(600)  # ended by the launcher, once rank 1 is lost


def test_a_rank_whose_actor_is_killed_from_outside_is_named_with_its_node(no_actor_left):
    node_id = ray.get_runtime_context().get_node_id()
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(
            print_parent_then_wait,
            num_processes=2,
            backend="ray",
            output="none",
            observers=[KillActorOfRank1()],
        )
    assert str(caught.value).startswith(
        f"Rank 1 (pid {caught.value.failures[0].pid}) was lost: its Ray actor on node "
        f"{ray.util.get_node_ip_address()} (node id {node_id[:12]}) died while the node stayed in the "
        "cluster (its worker process was killed from outside, or ran out of memory), and the "
        "rank with it. The other ranks were stopped."
    ), str(caught.value)
    assert [f.rank for f in caught.value.failures] == [1]


def test_a_rank_lost_with_its_node_is_the_root_cause_ahead_of_its_peers_closed_connection():
    from notebook_launcher.errors import RankFailure
    from notebook_launcher.launcher.rank_group import Outcome
    from notebook_launcher.launcher.report import rank_failed_error

    # The peer's collective fails at once; the kernel learns of the node a moment later.
    peer = RankFailure(
        0, 11, 1, "RuntimeError", "[pair.cc:534] Connection closed by peer", time=100.0
    )
    lost = RankFailure(
        1, 12, -9, lost="its Ray node 10.0.0.2 (node id 0123456789ab) left the cluster", time=101.0
    )
    error = rank_failed_error(Outcome(failures=[peer, lost]))
    assert str(error).startswith(
        "Rank 1 (pid 12) was lost: its Ray node 10.0.0.2 (node id 0123456789ab) left the cluster. "
        "The other ranks were stopped.\nAfterwards, rank 0 (pid 11) raised RuntimeError: "
    ), str(error)
    assert [f.rank for f in error.failures] == [1, 0]


def test_more_ranks_than_the_cluster_can_place_is_an_error_at_once(no_actor_left):
    from notebook_launcher.launcher.backends import ray as ray_backend

    # Judged against the cluster's totals before any actor exists: no wait, no race.
    with pytest.raises(
        ray_backend.RayClusterError,
        match=r"^Ray cannot place 3 ranks: each needs 1 CPU, and the cluster has 2 CPU\(s\) and "
        r"0 GPU\(s\) in all, on 1 node\(s\)\. Ask for at most 2 rank\(s\), or add machines",
    ):
        notebook_launcher(print, num_processes=3, backend="ray")


def test_ranks_that_other_work_keeps_from_their_cpus_fail_after_the_wait_naming_it(
    monkeypatch, no_actor_left
):
    from notebook_launcher.launcher.backends import ray as ray_backend

    @ray.remote(num_cpus=1)
    class Holder:
        def ready(self):
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())  # one of the two CPUs is taken by other work
    monkeypatch.setattr(ray_backend, "_PLACE_TIMEOUT_S", 3.0)
    try:
        with pytest.raises(
            ray_backend.RayClusterError,
            match=r"^Ray could not place [12] of 2 ranks within 3s: each needs 1 CPU; the cluster "
            r"has 2 CPU\(s\) in all and \d+ free now, the rest held by other work",
        ):
            notebook_launcher(print, num_processes=2, backend="ray")
    finally:
        ray.kill(holder)


def test_ray_refuses_multi_node_arguments_and_a_stray_address(cluster):
    with pytest.raises(LaunchUnsupportedError, match=r"backend='ray' with num_nodes=2: Ray places"):
        notebook_launcher(print, num_processes=1, num_nodes=2, backend="ray")
    with pytest.raises(
        LaunchConfigError, match=r"ray_address='auto' is only used with backend='ray'"
    ):
        notebook_launcher(print, ray_address="auto")


@pytest.mark.kernel
def test_ray_ranks_output_and_failure_show_in_the_notebook_cell(no_actor_left):
    from tests.support.kernel_driver import RunningKernel

    address = ray.get_runtime_context().gcs_address  # the module's cluster, joined by the kernel
    temp_dir = tempfile.mkdtemp()
    fifo = os.path.join(temp_dir, "printed")
    os.mkfifo(fifo)
    kernel = RunningKernel()
    try:
        setup = kernel.run(
            f"""
            import os
            os.environ.update({RAY_ENV!r})
            from notebook_launcher import notebook_launcher

            def greet():
                print("hello from rank", os.environ["RANK"], flush=True)
                # Rank 1 fails once rank 0 has written its line: the failure stops rank 0 at once.
                if os.environ["RANK"] == "0":
                    open({fifo!r}, "w").close()
                else:
                    open({fifo!r}).read()
                    raise ValueError("rank 1 is unhappy")
            """
        )
        assert setup.error is None, setup.error
        cell = kernel.run(
            f"notebook_launcher(greet, num_processes=2, backend='ray', ray_address={address!r})",
            timeout=900,
        )
    finally:
        kernel.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert "[rank0]: hello from rank 0\n" in cell.stdout
    assert "[rank1]: hello from rank 1\n" in cell.stdout
    assert cell.error is not None and cell.error["ename"] == "RankFailedError[ValueError]"
    assert "raised ValueError: rank 1 is unhappy" in cell.error["evalue"]


def test_a_local_rank_crash_is_still_reported_after_ray_ran_in_the_kernel(tmp_path, cluster):
    """A kernel that joined a Ray cluster and left it keeps faulthandler enabled, under a
    SIGSEGV handler Ray took back: forked ranks must install faulthandler anew."""
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        import ray

        ray.init(address=sys.argv[1], log_to_driver=False)
        ray.shutdown()
        from notebook_launcher import notebook_launcher

        def crash():
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)

        try:
            notebook_launcher(crash, num_processes=2, start_method="fork", output="none")
        except Exception as error:
            print("REPORT", "Fatal Python error: Segmentation fault" in str(error))
    """)
    )
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, str(script), address],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert "REPORT True" in done.stdout.splitlines(), done.stdout + done.stderr
