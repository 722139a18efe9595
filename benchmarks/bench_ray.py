"""backend="ray" against Ray Train's TorchTrainer, on the same local Ray cluster.

Both run the same 2-rank CPU job (gloo process group, one all_reduce, a value back) on
one cluster started once by this script (2 CPUs, loopback), in interleaved rounds so
that machine noise hits both alike. Also the cost of a launch that starts (and shuts
down) its own local cluster, which is what ``backend="ray"`` does without a cluster.
Prints medians and ratios.

Needs ``ray[train]`` for TorchTrainer (pandas, pyarrow, pydantic, tensorboardX)::

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/bench_ray.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

WORLD_SIZE = 2


def ours_job() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item()


def trainer_job(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from ray import train

    value = torch.ones(1)
    dist.all_reduce(value)  # TorchTrainer has set up the gloo process group already
    if value.item() != WORLD_SIZE:
        raise RuntimeError(f"all_reduce gave {value.item()}")
    train.report({"value": value.item()})


def ours() -> float:
    from notebook_launcher import notebook_launcher

    return float(
        notebook_launcher(ours_job, num_processes=WORLD_SIZE, backend="ray", output="none")
    )


def torch_trainer(storage: str) -> Callable[[], float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def run() -> float:
        result = TorchTrainer(
            trainer_job,
            scaling_config=ScalingConfig(num_workers=WORLD_SIZE, use_gpu=False),
            run_config=RunConfig(storage_path=storage, name=f"bench-{time.monotonic_ns()}"),
        ).fit()
        if result.error is not None:  # Ray Train reports metrics only with a checkpoint
            raise result.error
        return float(WORLD_SIZE)

    return run


def timed(function: Callable[[], float]) -> float:
    started = time.perf_counter()
    assert function() == float(WORLD_SIZE)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray

    # A launch that starts its own cluster (and shuts it down), before ours joins one.
    own_cluster = [timed(ours) for _ in range(rounds)]

    temp_dir = tempfile.mkdtemp(prefix="nlbench")
    ray.init(
        num_cpus=WORLD_SIZE,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
    )
    results_dir = tempfile.mkdtemp(prefix="nlbench-results")
    trainer = torch_trainer(results_dir)
    timings: dict[str, list[float]] = {"ours": [], "TorchTrainer": []}
    timed(ours)  # both warm: worker processes started, modules imported
    timed(trainer)
    for _ in range(rounds):
        timings["ours"].append(timed(ours))
        timings["TorchTrainer"].append(timed(trainer))
    ray.shutdown()
    for directory in (temp_dir, results_dir):
        shutil.rmtree(directory, ignore_errors=True)

    print(f"2 CPU ranks, gloo all_reduce, {rounds} rounds, medians (seconds):")
    base = statistics.median(timings["ours"])
    for name, values in timings.items():
        median = statistics.median(values)
        print(
            f"  {name:<32} {median:7.2f}  ({median / base:4.1f}x ours)  runs: "
            + ", ".join(f"{v:.2f}" for v in values)
        )
    median = statistics.median(own_cluster)
    print(
        f"  {'ours, starting its own cluster':<32} {median:7.2f}  runs: "
        + ", ".join(f"{v:.2f}" for v in own_cluster)
    )


if __name__ == "__main__":
    main()
