"""What the step anatomy costs: the same DDP training step with and without its timing.

2 CPU ranks with gloo, started by notebook_launcher. Each rank prepares two identical models
with the Accelerator (same weights, same batches, same DDP settings): one timed as every
prepared model is (the backward's wait for DDP's all-reduce, the optimizer step and the
data loader noted), one with the timing taken out (no forward hook, no clock; the loader's
notes go nowhere). Both keep DDP's built-in all-reduce. They run in interleaved blocks, the
order alternating every round, so that a change in machine speed (other work on a shared
machine) hits both alike. Prints the median step of each, their ratio, and the median of
the rounds' own ratios (each round's timed block against the untimed block beside it,
which drifts less with the load), for a small step (where a fixed cost shows most) and a
larger one, with the load average before and after. The target: timed / untimed <= 1.02.

    python benchmarks/bench_step_timing.py [--rounds 12] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

CASES = {"small step (width 256, batch 8)": (256, 8), "MLP step (width 1024, batch 64)": (1024, 64)}


def measure(rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """On each rank: the median step of each kind, and the median of the rounds' ratios."""
    import torch

    from notebook_launcher import Accelerator
    from notebook_launcher.accelerator import step_timing

    accelerator = Accelerator()
    results: dict[str, dict[str, float]] = {}
    for case, (width, batch) in CASES.items():
        loops: dict[str, Any] = {}
        for timed in (False, True):  # the untimed first: neither gains from coming second
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            data = torch.utils.data.DataLoader(
                torch.randn(batch * (rounds * steps + 8) * 2, width), batch_size=batch
            )
            original = step_timing.time_ddp
            if not timed:  # DDP's own all-reduce, no clock
                step_timing.time_ddp = lambda ddp, clock: None
            try:
                prepared = accelerator.prepare(model, optimizer, data)
            finally:
                step_timing.time_ddp = original
            if not timed:
                prepared[1]._on_step = None
            loops["timed" if timed else "untimed"] = (prepared, iter(prepared[2]))
        clock = step_timing._active
        times: dict[str, list[float]] = {"timed": [], "untimed": []}
        ratios: list[float] = []

        def run(name: str, count: int, loops: Any = loops, times: Any = times) -> None:
            (model, optimizer, _), batches = loops[name]
            step_timing._active = clock if name == "timed" else None  # noqa: B023 (the loader's notes)
            for _ in range(count):
                start = time.perf_counter()
                accelerator.backward(model(next(batches)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                times[name].append(time.perf_counter() - start)

        run("timed", 4)  # warm-up: DDP rebuilds its buckets after the first steps
        run("untimed", 4)
        for kept in times.values():
            kept.clear()
        for round_ in range(rounds):
            for name in ("timed", "untimed") if round_ % 2 == 0 else ("untimed", "timed"):
                run(name, steps)
            ratios.append(
                statistics.median(times["timed"][-steps:])
                / statistics.median(times["untimed"][-steps:])
            )
        step_timing._active = clock
        results[case] = {name: statistics.median(values) for name, values in times.items()}
        results[case]["round_ratio"] = statistics.median(ratios)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args()
    from notebook_launcher import notebook_launcher

    load_before = os.getloadavg()[0]
    results = notebook_launcher(
        measure, args=(options.rounds, options.steps), num_processes=2, dashboard=False
    )
    load_after = os.getloadavg()[0]
    print(
        f"2 CPU ranks, {options.rounds} interleaved rounds of {options.steps} steps each, "
        f"load {load_before:.1f} before, {load_after:.1f} after"
    )
    for case, medians in results.items():
        ratio = medians["timed"] / medians["untimed"]
        print(
            f"{case}: timed {medians['timed'] * 1000:.2f} ms, untimed "
            f"{medians['untimed'] * 1000:.2f} ms, ratio {ratio:.3f}, "
            f"median of the rounds' ratios {medians['round_ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
