"""One Ray node on loopback alone, run as a script by tests/support/ray_cluster.py; held until its
stdin closes, then stopped.

``ray start`` cannot make such a node: it turns 127.0.0.1 into the machine's outward
address, and with multi-node clusters switched off (what keeps 127.0.0.1) it refuses to
join a head. Ray's own ``Node`` (what ``ray.cluster_utils.Cluster`` uses) takes the
address as given, so the gcs_server, raylet and workers bind loopback alone.

Ray's raylet waits a fixed 15 s for each port its agents have not been given, and aborts
when an agent (a Python process importing Ray) reports later, which a busy machine makes
likely. So the node starts as the launcher's own local cluster does (ray_local's
node_start_awaited): every agent port is chosen and given, and the start waits for the
node's registration for as long as its raylet lives.

Prints one JSON line: the node's id, GCS address and raylet pid, or ``{"error": ...}``
when the node did not start (its raylet died meanwhile, said at once).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import psutil


def watch_raylet(started: threading.Event) -> None:
    """Fail the start at once (killing what it started) if the raylet dies during it."""
    raylet = None
    while not started.wait(0.5):
        if raylet is None:
            children = psutil.Process().children()
            raylet = next((child for child in children if _name(child) == "raylet"), None)
            continue
        if raylet.is_running() and raylet.status() != psutil.STATUS_ZOMBIE:
            continue
        fail(f"raylet {raylet.pid} exited while the node started")


def fail(why: str) -> None:
    """Report a failed start, end every process it started, and exit."""
    print(json.dumps({"error": why}), flush=True)
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(3)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def main() -> None:
    spec = json.loads(sys.argv[1])
    started = threading.Event()
    threading.Thread(target=watch_raylet, args=(started,), daemon=True).start()

    from ray._private.node import Node
    from ray._private.parameter import RayParams

    from notebook_launcher.launcher.backends.ray_local import node_start_awaited

    head = bool(spec.get("head"))
    params = RayParams(
        node_ip_address="127.0.0.1",
        gcs_address=spec.get("gcs_address"),
        num_cpus=spec["num_cpus"],
        num_gpus=0,
        resources=spec.get("resources") or {},
        temp_dir=spec["temp_dir"],
        include_dashboard=False,
        include_log_monitor=head,
        object_store_memory=80 * 1024 * 1024,
        min_worker_port=0,
        max_worker_port=0,
        node_manager_port=0,
    )
    try:
        with node_start_awaited():
            node = Node(params, head=head, shutdown_at_exit=False, spawn_reaper=False)
    except Exception as error:
        fail(f"the node did not start: {error}")
    started.set()
    # Reaped as soon as they end, as init reaps the processes of `ray start`: a raylet left
    # a zombie still looks alive to its workers, which then outlive it.
    for infos in node.all_processes.values():
        for info in infos:
            threading.Thread(target=info.process.wait, daemon=True).start()
    raylet = node.all_processes["raylet"][0].process.pid
    print(
        json.dumps(
            {"node_id": node.node_id, "gcs_address": node.gcs_address, "raylet_pid": raylet}
        ),
        flush=True,
    )
    sys.stdin.read()
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


if __name__ == "__main__":
    main()
