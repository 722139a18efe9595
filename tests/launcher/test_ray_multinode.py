"""backend="ray" on a cluster of several nodes: one process per node on this machine, every
node on loopback alone, joined by a real kernel with ray_address=.

The head node holds no CPU, so the kernel's Ray driver attaches to it and the two ranks
(one CPU each) can only be placed on the two other nodes, one on each.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import tempfile

import psutil
import pytest

pytest.importorskip("ray")

from tests.support.kernel_driver import RunningKernel, wait_for_output
from tests.support.ray_cluster import RAY_LOOPBACK_ENV, LoopbackRayCluster, RayNode, favour

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow(
        reason="starts a Ray cluster of two nodes, then a third, through a kernel: 1 to 2 min"
    ),
    pytest.mark.kernel,
]


@pytest.fixture
def cluster():
    """A head node and two nodes of one CPU each, stopped (and killed if need be) whatever
    the test did."""
    # Ray's socket paths must stay under 107 bytes: short folders.
    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")
    home = tempfile.mkdtemp(prefix="h", dir="/tmp")
    running = LoopbackRayCluster(temp_dir, home)
    try:
        running.add_node(num_cpus=0)
        running.add_node(num_cpus=1)
        running.add_node(num_cpus=1)
        yield running
    finally:
        running.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


SETUP = """
import os
os.environ.update({env!r})
from notebook_launcher import notebook_launcher

ADDRESS = {address!r}

def where_and_sum():
    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # through the store this kernel hosts on MASTER_ADDR
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    raylet = next(p.pid for p in psutil.Process().parents() if p.name() == "raylet")
    return raylet, os.environ["MASTER_ADDR"], total.item()

def blocked(fifo):
    import psutil

    raylet = next(p.pid for p in psutil.Process().parents() if p.name() == "raylet")
    print(f"blocked: pid {{os.getpid()}} under raylet {{raylet}}", flush=True)
    with open(fifo) as opened:  # returns once the test writes, which it never does
        opened.read()
"""


@pytest.fixture
def kernel(cluster):
    running = RunningKernel()
    favour(running.pid)
    try:
        env = {**RAY_LOOPBACK_ENV, "HOME": cluster.env["HOME"]}
        setup = running.run(SETUP.format(env=env, address=cluster.address))
        assert setup.error is None, setup.error
        yield running
    finally:
        running.shutdown()


def assert_nothing_left(kernel: RunningKernel, cluster: LoopbackRayCluster) -> None:
    """No rank actor alive in the cluster, no feeder thread in the kernel, no process of
    the ranks (their actors' workers and the ranks they forked) on any node."""
    cell = kernel.run(
        """
        import threading, time
        from ray._private import state

        def alive_actors():
            return [a["ActorID"] for a in state.actors().values() if a["State"] != "DEAD"]

        deadline = time.monotonic() + 300  # safety net: the kill reaches the GCS in its time
        while alive_actors() and time.monotonic() < deadline:
            time.sleep(0.2)
        (alive_actors(), [t.name for t in threading.enumerate() if "notebook_launcher" in t.name])
        """
    )
    assert cell.error is None, cell.error
    assert cell.result == "([], [])"
    ours = [p for p in cluster.processes() if "RankHost" in _cmdline(p)]
    _, alive = psutil.wait_procs(ours, timeout=300)
    assert alive == []


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_two_ranks_are_placed_on_two_nodes_and_meet_through_the_kernels_store(kernel, cluster):
    cell = kernel.run(
        "notebook_launcher(where_and_sum, num_processes=2, backend='ray', ray_address=ADDRESS, "
        "return_all=True)",
        timeout=900,
    )
    assert cell.error is None, cell.error
    values = ast.literal_eval(cell.result)
    _head, first, second = cluster.nodes
    assert sorted(raylet for raylet, _, _ in values) == sorted(
        [first.raylet_pid, second.raylet_pid]
    )
    # Both reached the store on the kernel's master_addr and summed ranks 0 and 1 (1 + 2).
    assert [(addr, total) for _, addr, total in values] == [("127.0.0.1", 3.0), ("127.0.0.1", 3.0)]
    assert_nothing_left(kernel, cluster)


def test_a_node_lost_mid_launch_fails_naming_the_rank_and_its_node(kernel, cluster):
    fifo = f"{cluster.temp_dir}/never"
    os.mkfifo(fifo)
    msg_id = kernel.submit(
        f"notebook_launcher(blocked, ({fifo!r},), num_processes=2, backend='ray', "
        "ray_address=ADDRESS)"
    )
    seen = wait_for_output(kernel, msg_id, ["[rank0]: blocked", "[rank1]: blocked"]).stdout
    where = {
        int(rank): (int(pid), int(raylet))
        for rank, pid, raylet in re.findall(
            r"\[rank(\d)\]: blocked: pid (\d+) under raylet (\d+)", seen
        )
    }
    assert sorted(where) == [0, 1], seen
    ranks = [psutil.Process(pid) for pid, _ in where.values()]
    lost_pid, lost_raylet = where[1]
    lost: RayNode = next(node for node in cluster.nodes if node.raylet_pid == lost_raylet)

    os.kill(lost_raylet, signal.SIGKILL)  # the node leaves the cluster mid-launch
    rest = kernel.collect(msg_id, timeout=900)  # a safety net: Ray notices a lost node in seconds

    assert rest.error is not None, rest.stdout + rest.stderr
    assert rest.error["ename"] == "RankFailedError"
    assert rest.error["evalue"].startswith(
        f"Rank 1 (pid {lost_pid}) was lost: its Ray node 127.0.0.1 (node id {lost.node_id[:12]}) "
        "left the cluster (its raylet stopped, or its machine went down or off the network), "
        "and the rank with it; `ray status` lists the nodes left. The other ranks were stopped."
    ), rest.error["evalue"]
    assert "Last output of rank 1:" in rest.error["evalue"]
    _, alive = psutil.wait_procs(ranks, timeout=300)
    assert alive == []
    assert_nothing_left(kernel, cluster)
