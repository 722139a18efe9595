"""LoRA fine-tuning side by side: notebook_launcher + our Accelerator against torchrun +
accelerate's Accelerator, on the same script, 2 CPU ranks.

A Llama built from a config (hidden 256, 4 layers, vocabulary 2048, no download), LoRA of
rank 8 on q_proj and v_proj, AdamW, per-rank batch 4 x 64 tokens. Each run trains the
same steps from the same seed; rounds go through the ways of launching (the
order rotating), so that a change in the machine's speed hits both. For each it prints:
whether the final adapters are bit-identical, the median step time (median over rounds of
each run's median), the peak RSS each rank grew by while training and its peak over the
whole run, and the ratios ours / accelerate. A third way (accelerate's Accelerator inside
notebook_launcher) tells the launcher's share from the core's. A last row trains the full model (no LoRA)
with our FSDP2 against our DDP, for each rank's memory.

    python benchmarks/bench_finetune.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, LAYERS, VOCAB, LENGTH, BATCH = 256, 4, 2048, 64, 4


def build(lora: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=LENGTH,
    ))  # fmt: skip
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )


def train(core: str, steps: int) -> dict[str, Any]:
    """One rank's training; ``core`` is "ours", "ours-fsdp", "ours-ddp-full" or "accelerate"."""
    import torch

    from notebook_launcher import rank_memory

    if core == "accelerate":
        from accelerate import Accelerator

        accelerator: Any = Accelerator(cpu=True)
    else:
        from notebook_launcher import Accelerator as Ours
        from notebook_launcher.accelerator.kwargs import FullyShardedDataParallelPlugin

        accelerator = Ours(
            fsdp_plugin=FullyShardedDataParallelPlugin() if core == "ours-fsdp" else None
        )
    lora = core in ("ours", "accelerate")
    model = build(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (BATCH * 2 * steps, LENGTH), generator=generator)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rank_memory.reset_peak()
    start = rank_memory.read().current_bytes
    times = []
    for ids in loader:
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - began)
    reading = rank_memory.read()
    state: dict[str, Any] = {}
    if lora:
        state = {
            k: v.detach().clone()
            for k, v in accelerator.unwrap_model(model).state_dict().items()
            if "lora_" in k
        }
    return {
        "rank": accelerator.process_index,
        "step_s": statistics.median(times[2:]),  # the first steps build buffers
        "growth_bytes": reading.peak_bytes - start,
        "adapter": state,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(steps: int) -> tuple[list[dict[str, Any]], list[int]]:
    import torch

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__,
            "--worker", out, "--steps", str(steps),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, capture_output=True)
        results = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in (0, 1)]
    return results, [r.pop("process_peak") for r in results]


def run_ours(core: str, steps: int) -> tuple[list[dict[str, Any]], list[int]]:
    from notebook_launcher import launches, notebook_launcher

    results = notebook_launcher(
        train, args=(core, steps), num_processes=2, hardware="cpu", output="none", return_all=True
    )
    peaks = [rank["peak_memory"]["peak_bytes"] for rank in launches()[-1]["ranks"]]
    return results, peaks


def worker(out: str, steps: int) -> None:
    import resource

    import torch
    import torch.distributed as dist

    result = train("accelerate", steps)
    result["process_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(result, f"{out}/rank{result['rank']}.pt")
    dist.destroy_process_group()


def _mb(values: list[float]) -> str:
    return " / ".join(f"{v / 1e6:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    # Imported before the launches fork: the ranks find them loaded (a notebook has them too).
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    rows: dict[str, list[Any]] = {"ours": [], "accelerate": [], "accelerate-in-launch": []}
    names = list(rows)
    for round_index in range(args.rounds):
        order = names[round_index % 3 :] + names[: round_index % 3]  # rotated every round
        for name in order:
            began = time.perf_counter()
            if name == "accelerate":
                results, peaks = run_torchrun(args.steps)
            else:
                results, peaks = run_ours("ours" if name == "ours" else "accelerate", args.steps)
            rows[name].append((results, peaks, time.perf_counter() - began))
    same = all(
        torch.equal(rows["ours"][-1][0][r]["adapter"][k], v)
        for r in (0, 1)
        for k, v in rows["accelerate"][-1][0][r]["adapter"].items()
    )
    print(
        f"LoRA, {args.steps} steps x {args.rounds} rounds, 2 CPU ranks; final adapters bit-identical: {same}"
    )
    print(
        "| | step time (median) | training growth per rank (MB) | process peak per rank (MB) | wall per run |"
    )
    print("|---|---|---|---|---|")
    summary = {}
    for name, label in (
        ("ours", "notebook_launcher + our Accelerator"),
        ("accelerate", "torchrun + accelerate"),
        ("accelerate-in-launch", "notebook_launcher + accelerate's Accelerator"),
    ):
        step = statistics.median(
            statistics.median(r["step_s"] for r in results) for results, _, _ in rows[name]
        )
        growth = [
            statistics.median(results[r]["growth_bytes"] for results, _, _ in rows[name])
            for r in (0, 1)
        ]
        peak = [statistics.median(peaks[r] for _, peaks, _ in rows[name]) for r in (0, 1)]
        wall = statistics.median(w for _, _, w in rows[name])
        summary[name] = (step, growth, peak, wall)
        print(f"| {label} | {step * 1e3:.1f} ms | {_mb(growth)} | {_mb(peak)} | {wall:.1f} s |")
    ours, theirs = summary["ours"], summary["accelerate"]
    print(
        f"| ratio ours / accelerate | {ours[0] / theirs[0]:.2f} | "
        f"{' / '.join(f'{a / b:.2f}' for a, b in zip(ours[1], theirs[1]))} | "
        f"{' / '.join(f'{a / b:.2f}' for a, b in zip(ours[2], theirs[2]))} | {ours[3] / theirs[3]:.2f} |"
    )
    full = {core: run_ours(core, args.steps) for core in ("ours-ddp-full", "ours-fsdp")}
    print()
    print(
        "Full fine-tuning (no LoRA), our Accelerator, peak RSS per rank (MB) while training / whole rank:"
    )
    for core, (results, peaks) in full.items():
        print(
            f"- {core}: {_mb([r['growth_bytes'] for r in results])} / {_mb(peaks)}; "
            f"step {statistics.median(r['step_s'] for r in results) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
