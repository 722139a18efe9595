"""Several machines on loopback, side by side with torchrun on the same script.

Each "machine" is one command: ``python -m notebook_launcher run train.py ...`` for this
launcher and ``python -m torch.distributed.run ... train.py`` for torchrun, with the same
node counts, endpoint and rendezvous options. For every case it prints how long each
machine took to end (or that it was still running when the bound stopped it), its exit
code, what was left behind (processes, listening ports) and the last line it wrote.

Every wait is bounded (``--bound``, 60 s by default): a machine still running then is
killed and reported as such. Loopback only.

    .venv/bin/python benchmarks/bench_multinode.py [--repeat 3] [--bound 60] [--only CASE]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

TRAIN = """
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
if "--die" in sys.argv and int(os.environ["GROUP_RANK"]) == 1:
    time.sleep(2)
    os.kill(os.getppid() if "--whole-machine" in sys.argv else os.getpid(), 9)
total = torch.ones(1)
dist.all_reduce(total)
if "--die" in sys.argv:
    time.sleep(5)
    dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ours(nproc: int, nnodes: int, node: int, endpoint: str, join_timeout: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "notebook_launcher",
        "run",
        "train.py",
        "-n",
        str(nproc),
        "--num-nodes",
        str(nnodes),
        "--node-rank",
        str(node),
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-conf",
        f"join_timeout={join_timeout}",
    ]


def torchrun(nproc: int, nnodes: int, node: int, endpoint: str, join_timeout: int) -> list[str]:
    host, port = endpoint.rsplit(":", 1)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node}",
        f"--master-addr={host}",
        f"--master-port={port}",
        "--rdzv-conf",
        f"join_timeout={join_timeout}",
        "train.py",
    ]


TOOLS = {"notebook_launcher": ours, "torchrun": torchrun}


def run_machines(
    commands: list[list[str]], folder: Path, bound: float, extra: list[str]
) -> list[dict]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    machines = []
    for command in commands:
        machines.append(
            subprocess.Popen(
                command + (["--", *extra] if "notebook_launcher" in command and extra else extra),
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
        time.sleep(0.2)
    results = []
    for machine in machines:
        try:
            output, _ = machine.communicate(timeout=max(0.1, bound - (time.monotonic() - started)))
            code: int | str = machine.returncode
        except subprocess.TimeoutExpired:
            descendants = psutil.Process(machine.pid).children(recursive=True)
            machine.kill()
            for child in descendants:
                child.kill()
            output, _ = machine.communicate()
            code = f"still running at {bound:g}s (killed)"
        lines = [
            line
            for line in output.splitlines()
            if line.strip() and not line.startswith(("[W", "frame #", "  "))
        ]
        results.append(
            {
                "seconds": time.monotonic() - started,
                "code": code,
                "last": lines[-1][:150] if lines else "",
                "lines": len(output.splitlines()),
            }
        )
    time.sleep(0.5)
    left = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "train.py" in " ".join(process.info["cmdline"] or []) and process.cwd() == str(
                folder
            ):
                left.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for result in results:
        result["left"] = len(left)
    for process in left:
        process.kill()
    return results


def case_happy(tool: str, folder: Path, bound: float) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"
    make = TOOLS[tool]
    return run_machines([make(2, 2, node, endpoint, 30) for node in (0, 1)], folder, bound, [])


def case_busy_port(tool: str, folder: Path, bound: float) -> list[dict]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        endpoint = f"127.0.0.1:{holder.getsockname()[1]}"
        return run_machines([TOOLS[tool](1, 1, 0, endpoint, 600)], folder, bound, [])


def case_absent_peer(tool: str, folder: Path, bound: float) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"
    return run_machines([TOOLS[tool](1, 2, 0, endpoint, 10)], folder, bound, [])


def case_absent_host(tool: str, folder: Path, bound: float) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"
    return run_machines([TOOLS[tool](1, 2, 1, endpoint, 10)], folder, bound, [])


def case_other_counts(tool: str, folder: Path, bound: float) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"
    make = TOOLS[tool]
    return run_machines(
        [make(2, 2, 0, endpoint, 30), make(1, 2, 1, endpoint, 30)], folder, bound, []
    )


def case_machine_dies(tool: str, folder: Path, bound: float) -> list[dict]:
    endpoint = f"127.0.0.1:{free_port()}"
    make = TOOLS[tool]
    return run_machines(
        [make(1, 2, node, endpoint, 30) for node in (0, 1)],
        folder,
        bound,
        ["--die", "--whole-machine"],
    )


CASES = {
    "happy path, 2 machines x 2 ranks": case_happy,
    "rendezvous port held by another program": case_busy_port,
    "node 0, its peer never comes (join_timeout=10)": case_absent_peer,
    "node 1, no host at the endpoint (join_timeout=10)": case_absent_host,
    "machines with 2 and 1 ranks": case_other_counts,
    "machine 1 killed mid-run (its launcher and ranks)": case_machine_dies,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--bound", type=float, default=60.0)
    parser.add_argument("--only", help="run the cases whose name contains this")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as folder:
        Path(folder, "train.py").write_text(textwrap.dedent(TRAIN))
        print(
            "| case | tool | machine | ends after (median s) | exit code | left behind | lines | last line |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, case in CASES.items():
            if options.only and options.only not in name:
                continue
            medians: dict[str, float] = {}
            for tool in TOOLS:
                runs = [case(tool, Path(folder), options.bound) for _ in range(options.repeat)]
                for machine in range(len(runs[0])):
                    seconds = statistics.median(run[machine]["seconds"] for run in runs)
                    last = runs[-1][machine]
                    medians.setdefault(tool, seconds)
                    print(
                        f"| {name} | {tool} | {machine} | {seconds:.1f} | {last['code']} | "
                        f"{last['left']} process(es) | {last['lines']} | {last['last'].replace('|', '/')} |",
                        flush=True,
                    )
            if len(medians) == 2:
                print(
                    f"| {name} | ratio torchrun / ours (first machine) | | "
                    f"{medians['torchrun'] / max(medians['notebook_launcher'], 1e-9):.2f} | | | | |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
