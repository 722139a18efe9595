"""Several machines, played by separate processes on loopback, each calling the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from notebook_launcher import LaunchConfigError, notebook_launcher
from notebook_launcher.launcher.rendezvous import RendezvousError
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

NODE = """
import json, os, sys
from notebook_launcher import notebook_launcher

backend, node_rank, endpoint, fail_rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def train():
    import psutil, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == fail_rank:
        raise ValueError(f"rank {fail_rank} gives up")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    # What the launching process (this machine's kernel) listens on.
    listening = sorted({c.laddr.ip for c in psutil.Process(os.getppid()).net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN})
    print(f"rank {dist.get_rank()} says hello")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
            "sum": total.item(), "listening": listening}

try:
    first = notebook_launcher(train, num_processes=2, num_nodes=2, node_rank=node_rank,
                              rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id="job7",
                              rdzv_conf={"join_timeout": 120}, timeout=240)
    both = None
    if fail_rank < 0:
        both = notebook_launcher(train, num_processes=2, num_nodes=2, node_rank=node_rank,
                                 rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id="job8",
                                 rdzv_conf={"join_timeout": 120}, timeout=240, return_all=True)
    print("RESULT " + json.dumps({"first": first, "all": both}))
except Exception as error:
    print("ERROR " + json.dumps({"types": [c.__name__ for c in type(error).__mro__], "text": str(error)}))
"""


def run_two_nodes(
    tmp_path: Path, backend: str, fail_rank: int = -1, source: str = NODE
) -> list[subprocess.CompletedProcess[str]]:
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(source))
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), backend, str(node_rank), endpoint, str(fail_rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for node_rank in (0, 1)
    ]
    done = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    return done


def tagged(
    node: subprocess.CompletedProcess[str],
    tag: str,
    nodes: list[subprocess.CompletedProcess[str]] | None = None,
) -> dict:
    """The one line ``tag`` printed by ``node``; where it is missing, the failure shows what
    every machine of ``nodes`` printed (one machine's failure is often another's cause)."""
    lines = [line for line in node.stdout.splitlines() if line.startswith(tag + " ")]
    shown = nodes or [node]
    assert len(lines) == 1, "\n".join(
        f"--- machine {i}:\n{other.stdout}{other.stderr}" for i, other in enumerate(shown)
    )
    return json.loads(lines[0][len(tag) + 1 :])


@pytest.mark.slow(reason="two machines (processes) with their ranks, per rendezvous")
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_machines_on_loopback_get_global_ranks_through_the_rendezvous(tmp_path, backend):
    nodes = run_two_nodes(tmp_path, backend)
    results = [tagged(node, "RESULT", nodes) for node in nodes]
    group_of_node = []
    for node, result in zip(nodes, results):
        values = result["all"]
        group = values[0]["group_rank"]
        group_of_node.append(group)
        # This machine's ranks: global rank = group_rank * num_processes + local_rank.
        assert [(v["rank"], v["local_rank"], v["group_rank"]) for v in values] == [
            (group * 2, 0, group),
            (group * 2 + 1, 1, group),
        ]
        assert all(v["world_size"] == 4 and v["sum"] == 6.0 for v in values)
        # Rank 0's value where this machine holds rank 0, else its own first rank's.
        assert result["first"]["rank"] == group * 2
        # Every store this machine hosts listens on the address given, never elsewhere.
        assert all(v["listening"] in ([], ["127.0.0.1"]) for v in values)
        # Each kernel shows its own ranks' output only.
        hello = sorted(line for line in node.stdout.splitlines() if "says hello" in line)
        assert hello == sorted(
            [f"[rank{r}]: rank {r} says hello" for r in (group * 2, group * 2 + 1)] * 2
        )
    assert sorted(group_of_node) == [0, 1]
    if backend == "static":
        assert group_of_node == [0, 1]  # the node ranks decide
    assert ["127.0.0.1"] in [v["listening"] for v in results[group_of_node.index(0)]["all"]]


@pytest.mark.slow(reason="two machines (processes) with their ranks")
def test_a_failing_rank_on_one_machine_fails_the_launch_on_both(tmp_path):
    nodes = run_two_nodes(tmp_path, "static", fail_rank=3)
    failing, other = tagged(nodes[1], "ERROR", nodes), tagged(nodes[0], "ERROR", nodes)
    assert "ValueError" in failing["types"] and "RankFailedError" in failing["types"]
    assert "Rank 3 (pid" in failing["text"] and "rank 3 gives up" in failing["text"]
    # The other machine's ranks lost their peer in the collective: they fail, not hang.
    assert "RankFailedError" in other["types"]


RESTARTING_NODE = """
import json, os, sys
from notebook_launcher import notebook_launcher

backend, node_rank, endpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def train():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 3 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise ValueError("the first attempt of rank 3 fails")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)  # rank 3's peers see it gone: their attempt fails too
    return dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"]), total.item()

values = notebook_launcher(train, num_processes=2, num_nodes=2, node_rank=node_rank,
                           rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id="job9",
                           rdzv_conf={"join_timeout": 120}, max_restarts=2, timeout=240,
                           return_all=True)
print("RESULT " + json.dumps(values))
"""


@pytest.mark.slow(reason="two machines (processes) fail and start again")
def test_both_machines_restart_together_after_a_failure(tmp_path):
    nodes = run_two_nodes(tmp_path, "static", source=RESTARTING_NODE)
    assert tagged(nodes[0], "RESULT", nodes) == [[0, 1, 6.0], [1, 1, 6.0]]
    assert tagged(nodes[1], "RESULT", nodes) == [[2, 1, 6.0], [3, 1, 6.0]]
    assert (
        "restart 1 of 2: rank 3 failed with ValueError: the first attempt of rank 3 fails"
        in nodes[1].stderr
    )
    assert "restart 1 of 2: rank " in nodes[0].stderr


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"num_nodes": 2, "node_rank": 2},
            r"node_rank=2 but num_nodes=2: node ranks run from 0 to 1\.",
        ),
        ({"num_nodes": 0}, r"num_nodes must be at least 1; got 0\."),
        ({"num_nodes": "2"}, r"num_nodes must be a whole number; got str '2'\."),
        ({"rdzv_backend": "etcd"}, r"rdzv_backend='etcd' is not known; use 'static'"),
        ({"rdzv_conf": ["timeout"]}, r"rdzv_conf must be a dict such as"),
        (
            {"rdzv_conf": {"join_timeout": -5}},
            r"rdzv_conf\['join_timeout'\] must be a positive number",
        ),
        ({"rdzv_id": ""}, r"rdzv_id must be a non-empty string"),
        (
            {"rdzv_conf": {"read_timeout": 5}},
            r"rdzv_conf has 'read_timeout', which this launcher does not use \(it would be ignored\); the keys it reads are join_timeout, ",
        ),
        (
            {"num_nodes": 2, "rdzv_endpoint": "10.0.0.1:port"},
            r"rdzv_endpoint='10.0.0.1:port' is not a 'host:port' address",
        ),
    ],
)
def test_bad_multi_node_arguments_are_refused_before_anything_starts(arguments, message):
    with pytest.raises(LaunchConfigError, match=message):
        notebook_launcher(print, **arguments)


def test_a_machine_that_cannot_reach_the_rendezvous_says_so(leak_check):
    endpoint = f"127.0.0.1:{free_port()}"  # nobody hosts it
    with pytest.raises(
        RendezvousError,
        match=r"node_rank=1 could not reach the rendezvous store at 127\.0\.0\.1:\d+ within join_timeout=2s \(nothing listens there yet\)\. Start the launch on the machine that hosts it too",
    ):
        notebook_launcher(
            print,
            num_processes=1,
            num_nodes=2,
            node_rank=1,
            rdzv_endpoint=endpoint,
            rdzv_conf={"join_timeout": 2},
        )


def test_one_machine_with_an_endpoint_goes_through_the_rendezvous(leak_check):
    endpoint = f"127.0.0.1:{free_port()}"

    def where():
        return os.environ["MASTER_ADDR"], os.environ["WORLD_SIZE"], os.environ["GROUP_RANK"]

    for backend in ("static", "c10d"):
        addr, world, group = notebook_launcher(
            where,
            num_processes=2,
            rdzv_backend=backend,
            rdzv_endpoint=endpoint,
            start_method="fork",
        )
        assert (addr, world, group) == ("127.0.0.1", "2", "0")
