"""A Ray cluster of several nodes on this machine, on loopback alone, for the tests.

Each node is a process of its own (tests/support/ray_node_host.py) whose children are that node's
Ray processes, so that one node can be lost while the others run, and every process the
cluster started can be found and ended, whatever happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

HOST = str(Path(__file__).with_name("ray_node_host.py"))

# For every process of the cluster and for the kernel that joins it: Ray keeps the node
# address 127.0.0.1 (and binds loopback alone) only with multi-node clusters switched off,
# which ray_node_host.py gets round for the nodes themselves.
RAY_LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_raylet_start_wait_time_s": "300",
}


def favour(pid: int, niceness: int = -10) -> None:
    """Let the scheduler favour a process that starts or joins a Ray cluster, and what it
    starts (children inherit this). Ray gives a new node a fixed 30 s to register, its
    raylet gives its agents a bounded wait too, and beside the other tests' work its
    processes (Python processes importing Ray) start slower than that; the Ray tests are
    also the longest chain of the suite. Only where the tests may (as root, as on CI)."""
    with contextlib.suppress(psutil.Error, OSError):
        psutil.Process(pid).nice(niceness)


_PORT_TRIES = 3  # starts of a node whose ports clashed with another component's


@dataclasses.dataclass
class RayNode:
    node_id: str
    gcs_address: str
    raylet_pid: int
    host: subprocess.Popen


class LoopbackRayCluster:
    def __init__(self, temp_dir: str, home: str) -> None:
        self.temp_dir = temp_dir
        self.env = {**os.environ, **RAY_LOOPBACK_ENV, "HOME": home}
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: list[RayNode] = []
        self._hosts: list[subprocess.Popen] = []  # every node process ever started
        self._seen: dict[int, psutil.Process] = {}  # every process of the cluster seen so far

    @property
    def address(self) -> str:
        return self.nodes[0].gcs_address

    def add_node(self, num_cpus: int, resources: dict[str, float] | None = None) -> RayNode:
        """Start a node (the first one is the head) and wait until it registered."""
        spec = {
            "head": not self.nodes,
            "num_cpus": num_cpus,
            "resources": resources or {},
            "temp_dir": self.temp_dir,
        }
        if self.nodes:
            spec["gcs_address"] = self.address
        # The node waits for its raylet's registration however long a busy machine makes it
        # (ray_node_host.py), and says at once when the raylet died. A port found free for one
        # of its agents may have been given to another component meanwhile, which Ray refuses:
        # started again, on fresh ports.
        for attempt in range(1, _PORT_TRIES + 1):
            host = subprocess.Popen(
                [sys.executable, HOST, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env,
                text=True,
            )
            self._hosts.append(host)
            favour(host.pid)  # before it has imported Ray, let alone started the node
            assert host.stdout is not None
            line = host.stdout.readline()
            info = json.loads(line) if line.startswith("{") else {"error": f"no report: {line!r}"}
            if "error" not in info:
                break
            self._end(host)
            if attempt == _PORT_TRIES or "that is used by other components" not in info["error"]:
                raise RuntimeError(f"a Ray node did not start: {info['error']}")
        node = RayNode(info["node_id"], info["gcs_address"], info["raylet_pid"], host)
        self.nodes.append(node)
        self.processes()  # remember them, for the end
        return node

    def processes(self, node: RayNode | None = None) -> list[psutil.Process]:
        """The live processes of one node (or of all of them): Ray's, its workers, the ranks."""
        found = []
        for host in [node.host] if node else self._hosts:
            with contextlib.suppress(psutil.NoSuchProcess):
                found += psutil.Process(host.pid).children(recursive=True)
        for process in found:
            self._seen.setdefault(process.pid, process)
        return found

    def stop(self) -> None:
        """Stop every node (the head last), and kill whatever of the cluster outlived that."""
        self.processes()
        for host in reversed(self._hosts):
            with contextlib.suppress(OSError):
                if host.stdin is not None:
                    host.stdin.close()
        for host in reversed(self._hosts):
            self._end(host)
        _, alive = psutil.wait_procs(list(self._seen.values()), timeout=60)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=30)

    def _end(self, host: subprocess.Popen) -> None:
        try:
            host.wait(timeout=120)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()
        if host.stdout is not None:
            host.stdout.close()
