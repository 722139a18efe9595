"""A cell on persistent ranks against ipyparallel's ``%%px``, side by side in one run.

The same cell (one all_reduce of 8 floats on 2 CPU ranks) runs on our session and on 2
ipyparallel engines joined in a gloo group by hand, in interleaved blocks so that machine
noise hits both alike:

1. inside one process: ``Session.execute`` against ``DirectView.execute(block=True)``
   (what ``%%px`` calls);
2. through a real Jupyter kernel, as a notebook client sees a cell (execute request to
   idle): ``%%distributed`` against ``%%px``, with that cell and with an empty one, next
   to the kernel's own round trip for an empty plain cell.

Also: starting a session of 2 CPU ranks against a fresh ``notebook_launcher()`` launch and
ipyparallel's cluster start; and how long a failure on one rank (while the other waits in
all_reduce) and an interrupt (both ranks sleeping) take to reach the caller. ipyparallel
is not timed there: its failed cell hangs until interrupted.

Needs ipyparallel (`pip install ipyparallel`; not a test dependency).

With ``--peers-python PYTHON`` (a virtual environment of its own holding jupyter-distributed
and nbdistributed, never the project's), only the kernels are compared: an empty cell on
our session, on jupyter-distributed's SPMD kernel (2 ranks) and on nbdistributed
(``%dist_init -n 2``), next to a plain kernel's empty cell, interleaved in one run.

    python benchmarks/bench_session.py [--cells 200] [--kernel-cells 100]
    python benchmarks/bench_session.py --peers-python /tmp/bench-venv/bin/python [--kernel-cells 100]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import threading
import time
import warnings
from typing import Any, Callable

CELL = "t = torch.ones(8) * (rank + 1)\ntorch.distributed.all_reduce(t)\n"
BLOCK = 20  # cells per contender before switching


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ipp_setup_code(port: int) -> str:
    return (
        "import os, torch, torch.distributed as dist\n"
        "os.environ['GLOO_SOCKET_IFNAME'] = 'lo'\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=rank, world_size=2)\n"
    )


def start_ipyparallel() -> tuple[Any, Any, float]:
    import ipyparallel as ipp

    started = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(2, timeout=120)
    view = client[:]
    elapsed = time.perf_counter() - started
    view.scatter("rank", [0, 1], flatten=True, block=True)
    view.execute(ipp_setup_code(free_port()), block=True)
    return cluster, view, elapsed


def timed(function: Callable[[], object], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return samples


def interleave(contenders: dict[str, Callable[[], object]], cells: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for function in contenders.values():
        timed(function, 5)  # warm-up
    for _ in range(max(1, cells // BLOCK)):
        for name, function in contenders.items():
            times[name] += timed(function, BLOCK)
    return times


def report(title: str, times: dict[str, list[float]], reference: str) -> None:
    base = statistics.median(times[reference])
    print(f"\n{title}")
    print(f"{'contender':44s} {'median ms':>10s} {'p90 ms':>8s} {'x ours':>8s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        p90 = sorted(samples)[int(len(samples) * 0.9)]
        print(f"{name:44s} {median * 1e3:10.2f} {p90 * 1e3:8.2f} {median / base:8.2f}")


def in_process(cells: int) -> None:
    from notebook_launcher import Session, notebook_launcher

    def launch_job() -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = torch.ones(8)
        dist.all_reduce(value)
        dist.destroy_process_group()
        return float(value.sum())

    launch = lambda: notebook_launcher(launch_job, num_processes=2, hardware="cpu", output="none")  # noqa: E731

    def session_start_close() -> None:
        Session(num_processes=2, hardware="cpu", output="none").close()

    def session_start_only() -> float:
        started = time.perf_counter()
        session = Session(num_processes=2, hardware="cpu", output="none")
        elapsed = time.perf_counter() - started
        session.close()
        return elapsed

    launch()
    session_start_close()
    starts = {
        "fresh notebook_launcher() launch (2 ranks, all_reduce)": [],
        "Session start (2 ranks, gloo up)": [],
    }
    for _ in range(10):
        starts["fresh notebook_launcher() launch (2 ranks, all_reduce)"] += timed(launch, 1)
        starts["Session start (2 ranks, gloo up)"].append(session_start_only())
    cluster, view, ipp_start = start_ipyparallel()
    try:
        launch_median = statistics.median(
            starts["fresh notebook_launcher() launch (2 ranks, all_reduce)"]
        )
        print("starting 2 CPU ranks, median of 10 interleaved")
        for name, samples in starts.items():
            median = statistics.median(samples)
            print(
                f"  {name:56s} {median * 1e3:9.1f} ms  ({median / launch_median:.2f}x a fresh launch)"
            )
        print(
            f"  {'ipyparallel Cluster(n=2) start + connect (once)':56s} {ipp_start * 1e3:9.1f} ms  "
            f"({ipp_start / launch_median:.1f}x a fresh launch)"
        )

        with Session(num_processes=2, hardware="cpu", output="none") as session:
            times = interleave(
                {
                    "ours: Session.execute": lambda: session.execute(CELL),
                    "ipyparallel: DirectView.execute(block=True)": lambda: view.execute(
                        CELL, block=True
                    ),
                },
                cells,
            )
            report(
                f"one cell (all_reduce of 8 floats, 2 CPU ranks), in this process, {cells} cells each",
                times,
                "ours: Session.execute",
            )
            failures_and_interrupts(session)
    finally:
        cluster.stop_cluster_sync()


def failures_and_interrupts(session: Any) -> None:
    failing = (
        "if rank == 1:\n    raise ValueError('bad')\ntorch.distributed.all_reduce(torch.ones(8))\n"
    )
    failure_s = []
    for _ in range(5):
        started = time.perf_counter()
        try:
            session.execute(failing)
        except ValueError:
            failure_s.append(time.perf_counter() - started)
        session.execute(CELL)  # the next cell works
    interrupt_s = []
    main = threading.main_thread().ident
    for _ in range(5):
        sent: list[float] = []

        def press_stop(sent: list[float] = sent) -> None:
            time.sleep(0.5)
            sent.append(time.perf_counter())
            signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]

        threading.Thread(target=press_stop).start()
        try:
            session.execute("import time\ntime.sleep(600)")
        except KeyboardInterrupt:
            interrupt_s.append(time.perf_counter() - sent[0])
        session.execute(CELL)
    print("\nhow fast the caller hears of trouble, median of 5 (the next cell works each time)")
    print(
        f"  rank 1 raises while rank 0 waits in all_reduce -> exception: {statistics.median(failure_s) * 1e3:8.1f} ms "
        "(includes cutting rank 0's collective after 0.25 s and rebuilding the process group)"
    )
    print(
        f"  stop button while both ranks sleep -> KeyboardInterrupt:    {statistics.median(interrupt_s) * 1e3:8.1f} ms"
    )


def through_kernel(cells: int) -> None:
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)

    def run(code: str) -> None:
        msg_id = client.execute(code)
        while True:
            message = client.get_iopub_msg(timeout=300)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "error":
                raise RuntimeError("\n".join(message["content"]["traceback"]))
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return

    try:
        run("%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu")
        run(
            "import ipyparallel as ipp, socket\n"
            "cluster = ipp.Cluster(n=2, log_level=40)\n"
            "rc = cluster.start_and_connect_sync()\n"
            "rc.wait_for_engines(2, timeout=120)\n"
            "view = rc[:]\nview.activate()\n"
            "view.scatter('rank', [0, 1], flatten=True, block=True)\n"
            f"view.execute({ipp_setup_code(free_port())!r}, block=True)\n"
        )
        times = interleave(
            {
                "an empty cell (the kernel's own round trip)": lambda: run("pass"),
                "ours: empty %%distributed cell": lambda: run("%%distributed\npass"),
                "ipyparallel: empty %%px cell": lambda: run("%%px\npass"),
                "ours: %%distributed cell": lambda: run("%%distributed\n" + CELL),
                "ipyparallel: %%px cell": lambda: run("%%px\n" + CELL),
            },
            cells,
        )
        report(
            f"the same cell through a Jupyter kernel, as the client sees it, {cells} cells each",
            times,
            "ours: %%distributed cell",
        )
        run("cluster.stop_cluster_sync()\n%distributed stop")
    finally:
        with_timeout_shutdown(manager, client)


def against_peers(peer_python: str, cells: int) -> None:
    """An empty cell on our session against jupyter-distributed and nbdistributed, each in a
    kernel of its own (the peers from their own environment), interleaved in one run."""
    import json
    import sys
    import tempfile

    from jupyter_client.manager import KernelManager

    specs = {
        "plain": ([sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], {}),
        "ours": ([sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], {}),
        "jupyter-distributed": (
            [peer_python, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
            {"JUPYTER_DISTRIBUTED_WORLD_SIZE": "2"},
        ),
        "nbdistributed": ([peer_python, "-m", "ipykernel_launcher", "-f", "{connection_file}"], {}),
    }
    setup = {
        "plain": "pass",
        "ours": "%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu",
        "jupyter-distributed": "pass",
        "nbdistributed": "%load_ext nbdistributed\n%dist_init -n 2",
    }
    cell = {
        "plain": "pass",
        "ours": "%%distributed\npass",
        "jupyter-distributed": "pass",
        "nbdistributed": "%%distributed\npass",
    }
    with tempfile.TemporaryDirectory() as home:
        for name, (argv, env) in specs.items():
            folder = os.path.join(home, "kernels", name)
            os.makedirs(folder)
            with open(os.path.join(folder, "kernel.json"), "w") as spec:
                json.dump(
                    {"argv": argv, "env": env, "display_name": name, "language": "python"}, spec
                )
        os.environ["JUPYTER_PATH"] = home
        running = {}
        try:
            for name in specs:
                manager = KernelManager(kernel_name=name)
                manager.start_kernel()
                client = manager.client()
                client.start_channels()
                client.wait_for_ready(timeout=300)
                running[name] = (manager, client)
                kernel_run(client, setup[name])
            times = interleave(
                {
                    f"{name}: an empty cell": (
                        lambda c=client, code=cell[name]: kernel_run(c, code)
                    )
                    for name, (_, client) in running.items()
                },
                cells,
            )
            report(
                f"an empty cell on 2 CPU ranks through a Jupyter kernel, {cells} cells each",
                times,
                "ours: an empty cell",
            )
        finally:
            for manager, client in running.values():
                with_timeout_shutdown(manager, client)


def kernel_run(client: Any, code: str) -> None:
    msg_id = client.execute(code)
    while True:
        message = client.get_iopub_msg(timeout=300)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "error":
            raise RuntimeError("\n".join(message["content"]["traceback"]))
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return


def with_timeout_shutdown(manager: Any, client: Any) -> None:
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="a cell on persistent ranks, side by side")
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--kernel-cells", type=int, default=100)
    parser.add_argument(
        "--peers-python",
        default=None,
        help="python of an environment with jupyter-distributed and nbdistributed",
    )
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if options.peers_python:
        against_peers(options.peers_python, options.kernel_cells)
        return
    in_process(options.cells)
    through_kernel(options.kernel_cells)


if __name__ == "__main__":
    main()
