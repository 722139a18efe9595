"""This project's big-model loading and offloaded inference beside accelerate's big_modeling.

A GPT-2 built from a config (no download; default 12 layers of width 512, about 160 MB in
float32) is saved as sharded safetensors with ``save_pretrained``. Then, for each library:

- **load**: in a fresh subprocess per run, ``init_empty_weights`` + ``load_checkpoint_and_dispatch``
  with a CPU budget of a fifth of the model (the rest offloaded to disk); the time of that
  call, and the peak resident memory it added (the process's high-water mark minus its
  resident memory before the call), medians of ``--load-runs`` interleaved runs;
- **forward**: in this process, one forward of a batch of one sequence (``--seq`` tokens,
  the shape of a generation step) through the model with most of it on disk, and through
  the model fully CPU-offloaded (``cpu_offload``, run on the CPU); both libraries'
  models side by side, timed in interleaved rounds, medians and ratios printed.

    python benchmarks/bench_big_model.py [--layers 12] [--width 512] [--rounds 15] [--seq 16]
    python benchmarks/bench_big_model.py --quick     # the forwards only, 9 rounds: about a minute

Besides wall-clock, each forward's CPU time (every thread of the process, the side thread's
included) is printed in brackets: on a busy machine it moves far less than wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_LOAD_SCRIPT = r"""
import json, os, sys, time
os.environ["TQDM_DISABLE"] = "1"
import torch
import transformers
transformers.logging.set_verbosity_error()
from transformers import GPT2Config, GPT2LMHeadModel
which, checkpoint, folder, budget = sys.argv[1:5]
if which == "ours":
    from notebook_launcher.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
else:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
config = GPT2Config.from_pretrained(checkpoint)
with init_empty_weights():
    model = GPT2LMHeadModel(config).eval()
model.tie_weights()
before = rss("VmRSS:")
start = time.perf_counter()
load_checkpoint_and_dispatch(model, checkpoint, device_map="auto", max_memory={"cpu": int(budget)},
                             offload_folder=folder, no_split_module_classes=["GPT2Block"])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_added": rss("VmHWM:") - before}))
"""


def build_checkpoint(folder: Path, layers: int, width: int) -> tuple[Any, int]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=8, vocab_size=8192, n_positions=256)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder, max_shard_size="50MB")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return config, size


def measure_loads(
    checkpoint: Path, size: int, runs: int, scratch: Path
) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, list[float]]] = {
        "ours": {"seconds": [], "peak_added": []},
        "accelerate": {"seconds": [], "peak_added": []},
    }
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for run in range(runs):
        order = ["ours", "accelerate"] if run % 2 == 0 else ["accelerate", "ours"]
        for which in order:
            folder = scratch / f"load-{which}-{run}"
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _LOAD_SCRIPT,
                    which,
                    str(checkpoint),
                    str(folder),
                    str(size // 5),
                ],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            for key, value in figures.items():
                results[which][key].append(value)
    return {w: {k: statistics.median(v) for k, v in r.items()} for w, r in results.items()}


def prepare_forward_models(
    config: Any, checkpoint: Path, size: int, scratch: Path
) -> dict[str, Any]:
    import accelerate
    import torch
    from transformers import GPT2LMHeadModel

    from notebook_launcher import big_modeling as ours

    models: dict[str, Any] = {}
    torch.manual_seed(0)
    models["memory/plain"] = GPT2LMHeadModel.from_pretrained(
        checkpoint
    ).eval()  # the floor: no offload
    for name, lib in (("ours", ours), ("accelerate", accelerate)):
        with lib.init_empty_weights():
            model = GPT2LMHeadModel(config).eval()
        model.tie_weights()
        device_map = lib.infer_auto_device_map(
            model, max_memory={"cpu": size // 5}, no_split_module_classes=["GPT2Block"]
        )
        lib.load_checkpoint_and_dispatch(
            model,
            str(checkpoint),
            device_map=device_map,
            offload_folder=str(scratch / f"disk-{name}"),
        )
        models[f"disk/{name}"] = model
        torch.manual_seed(0)
        full = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
        lib.cpu_offload(full, execution_device=torch.device("cpu"))
        models[f"cpu/{name}"] = full
    return models


def _cpu_seconds() -> float:
    """CPU time of the whole process (every thread: the side thread's reads count too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_forwards(
    models: dict[str, Any], rounds: int, seq: int, vocab: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Medians of wall-clock and of CPU seconds per forward, for each model."""
    import torch

    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        outputs = {k: m(ids).logits for k, m in models.items()}  # warm-up, and the check below
        for kind in ("disk", "cpu"):
            if not torch.equal(outputs[f"{kind}/ours"], outputs[f"{kind}/accelerate"]):
                raise SystemExit(f"{kind} offload: the two libraries' logits differ")
        names = list(models)
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                start, start_cpu = time.perf_counter(), _cpu_seconds()
                models[name](ids)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(_cpu_seconds() - start_cpu)
    return (
        {k: statistics.median(v) for k, v in times.items()},
        {k: statistics.median(v) for k, v in cpu.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--load-runs", type=int, default=3)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="forwards only (no load runs), 9 rounds: about a minute",
    )
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.load_runs, arguments.rounds = 0, min(arguments.rounds, 9)
    os.environ.setdefault("TQDM_DISABLE", "1")  # accelerate's per-weight progress bars
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    # One thread: on a shared machine, more threads than free cores make every time noise.
    torch.set_num_threads(arguments.threads)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        checkpoint = scratch / "checkpoint"
        config, size = build_checkpoint(checkpoint, arguments.layers, arguments.width)
        print(
            f"GPT-2, {arguments.layers} layers of width {arguments.width}: {size / 2**20:.1f} MiB "
            f"of weights, CPU budget {size / 5 / 2**20:.1f} MiB (the rest on disk)"
        )
        print(f"load average before: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
        if arguments.load_runs > 0:
            loads = measure_loads(checkpoint, size, arguments.load_runs, scratch)
            print(
                f"\nload_checkpoint_and_dispatch, medians of {arguments.load_runs} fresh processes each:"
            )
            print(f"{'':12} {'time':>9} {'peak RSS added':>15}")
            for which, figures in loads.items():
                print(
                    f"{which:12} {figures['seconds'] * 1000:7.0f} ms {figures['peak_added'] / 2**20:11.1f} MiB"
                )
            print(
                f"ratio ours/accelerate: time {loads['ours']['seconds'] / loads['accelerate']['seconds']:.2f}x, "
                f"peak {loads['ours']['peak_added'] / loads['accelerate']['peak_added']:.2f}x"
            )
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            models = prepare_forward_models(config, checkpoint, size, scratch)
        medians, cpu = time_forwards(models, arguments.rounds, arguments.seq, config.vocab_size)
        print(
            f"\nforward of 1 x {arguments.seq} tokens, medians of {arguments.rounds} interleaved "
            "rounds, wall-clock (CPU time of the process, all threads):"
        )
        for kind, label in (
            ("disk", "most of the model on disk"),
            ("cpu", "whole model CPU-offloaded"),
        ):
            ours_s, theirs = medians[f"{kind}/ours"], medians[f"{kind}/accelerate"]
            print(
                f"{label:28} ours {ours_s * 1000:6.1f} ms ({cpu[f'{kind}/ours'] * 1000:5.1f})   "
                f"accelerate {theirs * 1000:6.1f} ms ({cpu[f'{kind}/accelerate'] * 1000:5.1f})   "
                f"ratio {ours_s / theirs:.2f}x ({cpu[f'{kind}/ours'] / cpu[f'{kind}/accelerate']:.2f}x)"
            )
        floor, floor_cpu = medians["memory/plain"], cpu["memory/plain"]
        print(
            f"{'the model in memory (floor)':28} {floor * 1000:6.1f} ms ({floor_cpu * 1000:5.1f})"
        )
        print(
            f"ours against the model in memory: disk {medians['disk/ours'] / floor:.2f}x "
            f"({cpu['disk/ours'] / floor_cpu:.2f}x), cpu-offloaded {medians['cpu/ours'] / floor:.2f}x "
            f"({cpu['cpu/ours'] / floor_cpu:.2f}x); accelerate: disk "
            f"{medians['disk/accelerate'] / floor:.2f}x, cpu-offloaded {medians['cpu/accelerate'] / floor:.2f}x"
        )
        print(
            "targets (disk): at most 0.60x accelerate's and 1.30x the model in memory, wall-clock "
            "on a quiet machine; CPU time in brackets is the steadier figure on a busy one"
        )
        print(f"load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
