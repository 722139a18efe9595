"""Per-step time of raw DDP, this project's Accelerator and Hugging Face accelerate's.

A small MLP (3 Linear layers of width 1024), batch 64 per rank, 200 timed steps per loop,
2 CPU ranks with gloo, started by notebook_launcher. Each rank sets up the three loops
side by side, then runs them in interleaved rounds: a block of steps of each loop in
turn, the order rotating every round, so that a change in machine speed (other work on
a shared machine) hits all three alike. Every loop reads its batches from a DataLoader
(DistributedSampler for raw DDP, a prepared loader for the two Accelerators) and steps
an SGD optimizer. Prints, from rank 0, each loop's median step time over all its steps
and over the round blocks, and the ratios to raw DDP.

    python benchmarks/bench_accelerator.py [--rounds 10] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

WIDTH = 1024
BATCH = 64
WARMUP_STEPS = 10


def make_parts(world_size: int, samples_per_rank: int) -> tuple[Any, Any, Any]:
    import torch
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    samples = samples_per_rank * world_size
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(samples, WIDTH, generator=generator),
        torch.randn(samples, WIDTH, generator=generator),
    )
    return model, optimizer, data


class Loop:
    """One training loop, advanced a block of steps at a time."""

    def __init__(
        self, model: Any, optimizer: Any, loader: Any, backward: Callable[[Any], None]
    ) -> None:
        self.model, self.optimizer, self.loader, self.backward = model, optimizer, loader, backward
        self.batches = iter(loader)

    def step(self) -> None:
        import torch

        try:
            x, y = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            x, y = next(self.batches)
        self.backward(torch.nn.functional.mse_loss(self.model(x), y))
        self.optimizer.step()
        self.optimizer.zero_grad()

    def timed_steps(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def raw_ddp(samples_per_rank: int) -> Loop:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, optimizer, data = make_parts(dist.get_world_size(), samples_per_rank)
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
    return Loop(DistributedDataParallel(model), optimizer, loader, lambda loss: loss.backward())


def this_core(samples_per_rank: int) -> Loop:
    from torch.utils.data import DataLoader

    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="no")
    model, optimizer, data = make_parts(accelerator.num_processes, samples_per_rank)
    prepared = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    return Loop(*prepared, accelerator.backward)


def hf_accelerate(samples_per_rank: int) -> Loop:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(mixed_precision="no")
    model, optimizer, data = make_parts(accelerator.num_processes, samples_per_rank)
    prepared = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    return Loop(*prepared, accelerator.backward)


SETUPS = {"raw DDP": raw_ddp, "this core": this_core, "accelerate": hf_accelerate}


def benchmark(rounds: int, steps: int) -> dict[str, list[list[float]]]:
    """Runs in every rank; returns each loop's step times (seconds), one list per round."""
    import torch.distributed as dist

    block = max(1, steps // rounds)
    loops = {name: setup(WARMUP_STEPS * BATCH + steps * BATCH) for name, setup in SETUPS.items()}
    for loop in loops.values():
        for _ in range(WARMUP_STEPS):
            loop.step()
    times: dict[str, list[list[float]]] = {name: [] for name in loops}
    names = list(loops)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()  # every loop's block starts with the ranks together
            times[name].append(loops[name].timed_steps(block))
    return times


def overhead(steps: int = 3000, rounds: int = 10) -> dict[str, float]:
    """Median step time (seconds) of a tiny model in one process: what the core's wrappers add.

    The MLP benchmark's steps take tens of milliseconds, so on a shared machine noise hides
    a few microseconds of wrapper work; with a model this small the wrappers dominate.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_launcher.accelerator import Accelerator

    def parts() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        data = TensorDataset(torch.randn(steps * 4, 8), torch.randn(steps * 4, 8))
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), DataLoader(data, batch_size=4)

    model, optimizer, loader = parts()
    loops = {"raw loop": Loop(model, optimizer, loader, lambda loss: loss.backward())}
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    loops["this core"] = Loop(*accelerator.prepare(*parts()), accelerator.backward)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(rounds):
        for name in list(loops)[round_index % 2 :] + list(loops)[: round_index % 2]:
            times[name] += loops[name].timed_steps(steps // rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per loop")
    parser.add_argument("--num-processes", type=int, default=2)
    options = parser.parse_args()

    import torch

    from notebook_launcher import notebook_launcher

    started = time.perf_counter()
    times = notebook_launcher(
        benchmark,
        args=(options.rounds, options.steps),
        num_processes=options.num_processes,
        hardware="cpu",
    )
    block = max(1, options.steps // options.rounds)
    print(
        f"MLP 3 x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank, {options.rounds} interleaved "
        f"rounds x {block} steps per loop, {options.num_processes} CPU ranks (gloo), "
        f"torch {torch.__version__}; rank 0's step times"
    )
    medians = {
        name: statistics.median(t for r in rounds for t in r) for name, rounds in times.items()
    }
    block_medians = {
        name: statistics.median(statistics.fmean(r) for r in rounds)
        for name, rounds in times.items()
    }
    print(
        f"{'loop':<12} {'median ms/step':>15} {'ratio':>7} {'median block mean':>18} {'ratio':>7}"
    )
    for name in times:
        print(
            f"{name:<12} {medians[name] * 1e3:>15.2f} {medians[name] / medians['raw DDP']:>6.3f}x "
            f"{block_medians[name] * 1e3:>18.2f} {block_medians[name] / block_medians['raw DDP']:>6.3f}x"
        )
    print("block means per round (ms/step):")
    for name, rounds in times.items():
        print(f"  {name:<12} " + " ".join(f"{statistics.fmean(r) * 1e3:.1f}" for r in rounds))
    tiny = overhead()
    print(
        f"one process, Linear(8, 8), batch 4: raw loop {tiny['raw loop'] * 1e6:.1f} us/step, "
        f"this core {tiny['this core'] * 1e6:.1f} us/step "
        f"(+{(tiny['this core'] - tiny['raw loop']) * 1e6:.1f} us per step)"
    )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
