"""Launch overhead against the peers, side by side in one run.

Each contender launches the same N-rank job many times in this one process (gloo init,
one all_reduce, destroy, return), in interleaved rounds so that machine noise hits all
of them alike; each round starts one contender later than the last. Prints medians and
ratios for each N; also how long a rank's exception takes to surface as the caller's
exception. On the 2-core machine single launches of the same job vary by a third; with
15 rounds the ratio of two medians moved by 0.1 between runs of the same code, with 60 by
about 0.02.

    python benchmarks/bench_launch.py [--rounds 60] [--world-sizes 2,4,8] [--no-accelerate]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings
from typing import Callable

WORLD_SIZE = 2


def job(*_: object) -> float:
    import torch
    import torch.distributed as dist

    owned = not dist.is_initialized()  # accelerate.debug_launcher creates (and owns) one
    if owned:
        dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    if owned:
        dist.destroy_process_group()
    return value.item()


def floor_job(index: int, port: int) -> None:
    """torch.multiprocessing's target: it sets no environment, so the job does it."""
    os.environ.update(
        RANK=str(index), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    job()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ours(method: str) -> Callable[[], object]:
    from notebook_launcher import notebook_launcher

    return lambda: notebook_launcher(
        job, num_processes=WORLD_SIZE, start_method=method, output="none"
    )


def torch_fork_floor() -> object:
    import torch.multiprocessing as tmp

    return tmp.start_processes(floor_job, (free_port(),), nprocs=WORLD_SIZE, start_method="fork")


def accelerate_notebook_launcher() -> object:
    from accelerate import notebook_launcher

    return notebook_launcher(job, num_processes=WORLD_SIZE, use_port=str(free_port()))


def accelerate_debug_launcher() -> object:
    from accelerate import debug_launcher

    return debug_launcher(job, num_processes=WORLD_SIZE)


def measure(rounds: int, with_accelerate: bool) -> None:
    """Every contender at ``WORLD_SIZE`` ranks, interleaved; prints medians and ratios."""
    contenders: dict[str, Callable[[], object]] = {
        "start_processes fork (floor)": torch_fork_floor,
        "notebook_launcher fork": ours("fork"),
        "notebook_launcher forkserver (warm)": ours("forkserver"),
    }
    if with_accelerate:
        contenders["accelerate.notebook_launcher"] = accelerate_notebook_launcher
        contenders["accelerate.debug_launcher"] = accelerate_debug_launcher
    for launch in contenders.values():  # warm-up: imports, the forkserver's first start
        launch()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders.items())
    for round_ in range(rounds):
        # Each round starts one contender later, so none always follows the same one
        # (whose exit, freed memory and imports it would otherwise always inherit).
        shift = round_ % len(order)
        for name, launch in order[shift:] + order[:shift]:
            started = time.perf_counter()
            launch()
            times[name].append(time.perf_counter() - started)
    floor = statistics.median(times["start_processes fork (floor)"])
    peer = "accelerate.notebook_launcher"
    print(f"\nlaunch of a {WORLD_SIZE}-rank gloo job, median of {rounds} interleaved rounds")
    print(f"{'contender':40s} {'median ms':>10s} {'x floor':>8s} {'x accelerate':>13s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        against = f"{median / statistics.median(times[peer]):13.2f}" if peer in times else " " * 13
        print(f"{name:40s} {median * 1e3:10.1f} {median / floor:8.2f} {against}")


def raise_on_rank_one(*_: object) -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError(repr(time.time()))
    time.sleep(30)


def failure_latency(launch: Callable[[], object]) -> float:
    """Seconds from the rank raising to the caller holding the exception."""
    try:
        launch()
    except BaseException as error:  # accelerate wraps it in its own types
        caught = time.time()
        raised = next(float(t) for t in _floats_in(str(error)))
        return caught - raised
    raise AssertionError("the failing launch did not raise")


def _floats_in(text: str) -> list[str]:
    import re

    return re.findall(r"\d{10}\.\d+", text)


def main() -> None:
    global WORLD_SIZE
    parser = argparse.ArgumentParser(description="launch overhead, side by side")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--world-sizes", default="2", help="rank counts, e.g. 2,4,8")
    parser.add_argument("--no-accelerate", action="store_true", help="leave accelerate out")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for size in (int(n) for n in options.world_sizes.split(",")):
        WORLD_SIZE = size
        measure(options.rounds, not options.no_accelerate)
    WORLD_SIZE = 2

    from notebook_launcher import notebook_launcher

    latencies = {
        "notebook_launcher fork": lambda: notebook_launcher(
            raise_on_rank_one, num_processes=WORLD_SIZE, output="none"
        ),
        "notebook_launcher forkserver": lambda: notebook_launcher(
            raise_on_rank_one, num_processes=WORLD_SIZE, start_method="forkserver", output="none"
        ),
    }
    print("\nrank raises -> caller's exception, median of 5")
    for name, launch in latencies.items():
        samples = [failure_latency(launch) for _ in range(5)]
        print(f"{name:40s} {statistics.median(samples) * 1e3:10.1f} ms")


if __name__ == "__main__":
    main()
