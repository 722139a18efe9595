"""What the step anatomy costs: the same DDP training step with and without its timing.

2 CPU ranks with gloo, started by notebook_launcher. Each rank prepares one model with the
Accelerator and runs it in blocks of steps, timed as every prepared model is (the backward's
wait for DDP's all-reduce, the optimizer step and the data loader noted) or with the timing
taken off (no forward hook, no clock; the loader's notes go nowhere): the very same DDP
model, buckets, optimizer and loader either way (two separately prepared models, one of them
doing strictly more, measured up to 10 % faster than the other in some runs). DDP keeps its
built-in all-reduce either way. The blocks are interleaved, the order alternating every
round, so that a change in machine speed (other work on a shared machine) hits both alike.
Prints the median step of each, their ratio, and the median of the rounds' own ratios (each
round's timed block against the untimed block beside it, which drifts less with the load),
for a small step (where a fixed cost shows most) and a larger one, with the load average
before and after. On a shared 2-core machine these ratios still swing by 5-15 % from run to
run, so it also measures the timing's own work directly, in one process (``direct_cost``),
and gives it as a share of each step. The target: timed / untimed <= 1.02.

    python benchmarks/bench_step_timing.py [--rounds 12] [--steps 20]
    python benchmarks/bench_step_timing.py --rounds 480 --steps 1   # alternate every step
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
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = torch.utils.data.DataLoader(
            torch.randn(2 * batch * (2 * rounds * steps + 16), width), batch_size=batch
        )
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        clock = step_timing._active
        on_step = optimizer._on_step
        handle = None  # the forward hook time_ddp put on the model at prepare()
        model._forward_hooks.clear()
        batches = iter(data)
        times: dict[str, list[float]] = {"timed": [], "untimed": []}
        ratios: list[float] = []

        def run(name: str, count: int, model: Any = model, optimizer: Any = optimizer) -> None:
            nonlocal handle
            timed = name == "timed"
            # The very same model, optimizer and loader either way: only the timing differs.
            if timed:
                handle = step_timing.time_ddp(model, clock)  # noqa: B023
            elif handle is not None:
                handle.remove()
            optimizer._on_step = on_step if timed else None  # noqa: B023
            step_timing._active = clock if timed else None  # noqa: B023 (the loader's notes)
            for _ in range(count):
                start = time.perf_counter()
                accelerator.backward(model(next(batches)).pow(2).mean())  # noqa: B023
                optimizer.step()
                optimizer.zero_grad()
                times[name].append(time.perf_counter() - start)  # noqa: B023
            if timed:
                handle.remove()  # type: ignore[union-attr]
                handle = None

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
        optimizer._on_step = on_step
        results[case] = {name: statistics.median(values) for name, values in times.items()}
        results[case]["round_ratio"] = statistics.median(ratios)
    return results


def direct_cost(pairs: int = 2000) -> dict[str, float]:
    """The timing's own work a step, in one process without ranks (far less noise than a
    ratio of two DDP steps): the same small backward with and without the forward hook and
    its final callbacks (alternating, median of the pairs' differences), and the clock's
    bookkeeping (a step ended, a batch's wait noted), in seconds."""
    import torch

    from notebook_launcher.accelerator import step_timing

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    )
    x = torch.randn(8, 256)
    clock = step_timing.StepClock(0, 2)
    clock._last_report = float("inf")  # nobody listens here
    tail = step_timing._BackwardTail(clock)

    def step(timed: bool) -> float:
        start = time.perf_counter()
        out = model(x)
        if timed:
            tail(model, (x,), out)
        out.pow(2).mean().backward()
        return time.perf_counter() - start

    differences = []
    for pair in range(pairs):
        if pair % 2:
            untimed, timed = step(False), step(True)
        else:
            timed, untimed = step(True), step(False)
        differences.append(timed - untimed)
    start = time.perf_counter()
    for _ in range(pairs):
        clock.add_data_wait(time.perf_counter() - start)
        clock.step_ended()
    bookkeeping = (time.perf_counter() - start) / pairs
    return {"backward_tail": statistics.median(differences), "bookkeeping": bookkeeping}


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
    cost = direct_cost()
    per_step = cost["backward_tail"] + cost["bookkeeping"]
    print(
        f"direct cost a step, one process: backward tail {cost['backward_tail'] * 1e6:.1f} us, "
        f"clock {cost['bookkeeping'] * 1e6:.1f} us, together {per_step * 1e6:.1f} us"
    )
    for case, medians in results.items():
        ratio = medians["timed"] / medians["untimed"]
        print(
            f"{case}: timed {medians['timed'] * 1000:.2f} ms, untimed "
            f"{medians['untimed'] * 1000:.2f} ms, ratio {ratio:.3f}, "
            f"median of the rounds' ratios {medians['round_ratio']:.3f}; the direct cost is "
            f"{per_step / medians['untimed'] * 100:.2f} % of the untimed step"
        )


if __name__ == "__main__":
    main()
