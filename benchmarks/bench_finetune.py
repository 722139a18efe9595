"""LoRA fine-tuning side by side: notebook_launcher + our Accelerator against torchrun +
accelerate's Accelerator, on the same script, 2 CPU ranks.

A Llama built from a config (hidden 256, 4 layers, vocabulary 2048, no download), LoRA of
rank 8 on q_proj and v_proj, AdamW, per-rank batch 4 x 64 tokens. Each run trains the
same steps from the same seed; rounds go through the ways of launching (the
order rotating), so that a change in the machine's speed hits both. A third way
(accelerate's Accelerator inside notebook_launcher) tells the launcher's share from the
core's. For each it prints whether the final adapters are bit-identical, and, as medians
over rounds of each run's median past the warm-up steps:

- where a step's time goes in the training thread: on a CPU (its CPU time), runnable but
  waiting for a CPU (the scheduler's run queue, from /proc/thread-self/schedstat), and
  the rest (blocked: waiting for the peer in the all-reduce, or for memory);
- the rank's CPU time a step (every thread: gloo's too), which a busy machine moves far
  less than the wall-clock time;
- whether the ranks lead sessions of their own (CPU time is shared by session where
  Linux's autogroups are on), the peak RSS each rank grew by while training and its peak
  over the whole run, the wall time of a run, and the ratios ours / torchrun.

Then the step anatomy our launches recorded (``launches()``) and its sentence. A last part
trains the full model (no LoRA) with our FSDP2 against our DDP, for each rank's memory
(left out by ``--quick``).

    python benchmarks/bench_finetune.py [--rounds 3] [--steps 30] [--warmup 3]
    python benchmarks/bench_finetune.py --quick     # 2 rounds of 12 steps, LoRA only
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
_SCHEDSTAT = "/proc/thread-self/schedstat"  # on-CPU and run-queue nanoseconds (Linux)


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


def _run_queue_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (0.0 where unknown)."""
    try:
        with open(_SCHEDSTAT, encoding="ascii") as file:
            return int(file.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def train(core: str, steps: int, warmup: int = 3) -> dict[str, Any]:
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
    samples = []  # (wall, rank CPU, thread CPU, run queue) of each step
    for ids in loader:
        wall, cpu, thread, queued = (
            time.perf_counter(), time.process_time(), time.thread_time(), _run_queue_s()
        )  # fmt: skip
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        samples.append((
            time.perf_counter() - wall, time.process_time() - cpu,
            time.thread_time() - thread, _run_queue_s() - queued,
        ))  # fmt: skip
    reading = rank_memory.read()
    state: dict[str, Any] = {}
    if lora:
        state = {
            k: v.detach().clone()
            for k, v in accelerator.unwrap_model(model).state_dict().items()
            if "lora_" in k
        }
    # The first steps build buffers, and a forked rank faults in the kernel's pages.
    kept = samples[min(warmup, len(samples) - 1) :]
    step, cpu, thread, queued = (statistics.median(column) for column in zip(*kept))
    return {
        "rank": accelerator.process_index,
        "step_s": step,
        "cpu_s": cpu,
        "thread_cpu_s": thread,
        "run_queue_s": queued,
        "own_session": os.getsid(0) == os.getpid(),
        "growth_bytes": reading.peak_bytes - start,
        "adapter": state,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(steps: int, warmup: int) -> tuple[list[dict[str, Any]], list[int]]:
    import torch

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__,
            "--worker", out, "--steps", str(steps), "--warmup", str(warmup),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, capture_output=True)
        results = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in (0, 1)]
    return results, [r.pop("process_peak") for r in results]


_anatomies: dict[str, list[Any]] = {}  # what our launches recorded, by way of launching


def _refuse_setsid() -> None:
    raise PermissionError("left in the launching process's session by the benchmark")


def run_ours(
    core: str, steps: int, warmup: int, kernel_session: bool = False
) -> tuple[list[dict[str, Any]], list[int]]:
    from notebook_launcher import launches, notebook_launcher

    setsid = os.setsid
    if kernel_session:
        # Forked ranks inherit the refusal and stay in this process's session, in a process
        # group of their own: where launched ranks were before they led sessions.
        os.setsid = _refuse_setsid
    try:
        results = notebook_launcher(
            train,
            args=(core, steps, warmup),
            num_processes=2,
            hardware="cpu",
            output="none",
            return_all=True,
            start_method="fork",
        )
    finally:
        os.setsid = setsid
    record = launches()[-1]
    way = "kernel-session" if kernel_session else core
    _anatomies.setdefault(way, []).append(
        ([rank["steps"] for rank in record["ranks"]], record.get("diagnosis"))
    )
    peaks = [rank["peak_memory"]["peak_bytes"] for rank in record["ranks"]]
    return results, peaks


def worker(out: str, steps: int, warmup: int) -> None:
    import resource

    import torch
    import torch.distributed as dist

    result = train("accelerate", steps, warmup)
    result["process_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(result, f"{out}/rank{result['rank']}.pt")
    dist.destroy_process_group()


def _mb(values: list[float]) -> str:
    return " / ".join(f"{v / 1e6:.0f}" for v in values)


def _scheduler() -> str:
    """Whether the CPU scheduler shares time by session here (Linux's autogroups)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled", encoding="ascii") as file:
            enabled = file.read().strip() == "1"
    except OSError:
        return "CPU scheduler: no autogroups (not Linux, or built without them)"
    # Autogroups apply only to processes in the root CPU cgroup (not in a container's).
    rooted = True
    try:
        with open("/proc/self/cgroup", encoding="ascii") as file:
            for line in file:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "cpu" in controllers.split(",") or controllers == "":
                    rooted = rooted and path == "/"
    except OSError:
        pass
    state = (
        "on" if enabled and rooted else "off" if not enabled else "on, but not for this CPU cgroup"
    )
    return f"CPU scheduler: autogroups (CPU time shared by session) {state}"


WAYS = (
    ("ours", "notebook_launcher + our Accelerator"),
    ("accelerate", "torchrun + accelerate"),
    ("accelerate-in-launch", "notebook_launcher + accelerate's Accelerator"),
)
KERNEL_SESSION = ("kernel-session", "notebook_launcher + ours, ranks in the kernel's session")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds of 12 steps, LoRA only (a few minutes)"
    )
    parser.add_argument(
        "--kernel-session",
        action="store_true",
        help="a fourth way: our launch with its ranks left in the launching process's session",
    )
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return
    if args.quick:
        args.rounds, args.steps = 2, 12
    # Imported before the launches fork: the ranks find them loaded (a notebook has them too).
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    began_all = time.perf_counter()
    ways = WAYS + ((KERNEL_SESSION,) if args.kernel_session else ())
    rows: dict[str, list[Any]] = {name: [] for name, _ in ways}
    loads: list[float] = []
    names = list(rows)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # the order rotated every round
            began = time.perf_counter()
            if name == "accelerate":
                results, peaks = run_torchrun(args.steps, args.warmup)
            else:
                core = "accelerate" if name == "accelerate-in-launch" else "ours"
                results, peaks = run_ours(
                    core, args.steps, args.warmup, kernel_session=name == "kernel-session"
                )
            rows[name].append((results, peaks, time.perf_counter() - began))
            loads.append(os.getloadavg()[0])
    same = all(
        torch.equal(rows["ours"][-1][0][r]["adapter"][k], v)
        for r in (0, 1)
        for k, v in rows["accelerate"][-1][0][r]["adapter"].items()
    )
    print(
        f"LoRA, {args.steps} steps x {args.rounds} rounds (first {args.warmup} steps of each "
        f"run left out), 2 CPU ranks on {os.cpu_count()} cores, load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs; final adapters bit-identical: {same}"
    )
    print(_scheduler())
    print()
    print(
        "| | step (median) | on a CPU | waiting for a CPU | blocked | rank CPU a step "
        "| own sessions | training growth per rank (MB) | process peak per rank (MB) | wall per run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def median_of(name: str, key: str) -> float:
        return statistics.median(
            statistics.median(r[key] for r in results) for results, _, _ in rows[name]
        )

    summary = {}
    for name, label in ways:
        step, thread, queued, cpu = (
            median_of(name, key) for key in ("step_s", "thread_cpu_s", "run_queue_s", "cpu_s")
        )
        blocked = max(0.0, step - thread - queued)
        growth = [
            statistics.median(results[r]["growth_bytes"] for results, _, _ in rows[name])
            for r in (0, 1)
        ]
        peak = [statistics.median(peaks[r] for _, peaks, _ in rows[name]) for r in (0, 1)]
        wall = statistics.median(w for _, _, w in rows[name])
        own = all(r["own_session"] for results, _, _ in rows[name] for r in results)
        summary[name] = (step, thread, queued, blocked, cpu, growth, peak, wall)
        print(
            f"| {label} | {step * 1e3:.1f} ms | {thread * 1e3:.1f} ms | {queued * 1e3:.1f} ms "
            f"| {blocked * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {'yes' if own else 'no'} "
            f"| {_mb(growth)} | {_mb(peak)} | {wall:.1f} s |"
        )
    ours, theirs = summary["ours"], summary["accelerate"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b > 0 else "-"

    print(
        f"| ratio ours / torchrun | {ratio(ours[0], theirs[0])} | {ratio(ours[1], theirs[1])} "
        f"| {ratio(ours[2], theirs[2])} | {ratio(ours[3], theirs[3])} | {ratio(ours[4], theirs[4])} | "
        f"| {' / '.join(ratio(a, b) for a, b in zip(ours[5], theirs[5]))} "
        f"| {' / '.join(ratio(a, b) for a, b in zip(ours[6], theirs[6]))} | {ratio(ours[7], theirs[7])} |"
    )
    pairs = [("ours", "accelerate", "ours / torchrun")]
    if args.kernel_session:
        pairs.append(("kernel-session", "ours", "ranks in the kernel's session / in their own"))
    for mine_name, peer_name, pair in pairs:
        for key, label in (("step_s", "step"), ("cpu_s", "rank CPU a step")):
            per_round = [
                statistics.median(r[key] for r in mine[0])
                / statistics.median(r[key] for r in peer[0])
                for mine, peer in zip(rows[mine_name], rows[peer_name])
            ]
            print(
                f"Ratio {pair} of the {label} in each round: "
                + ", ".join(f"{value:.2f}" for value in per_round)
            )
    print()
    print("The step anatomy of our last launch (launches()[-1]['ranks'][i]['steps'], medians):")
    steps_seen, diagnosis = _anatomies["ours"][-1]
    for rank, s in enumerate(steps_seen):
        if s is not None:
            print(
                f"- rank {rank}: step {s['median_s'] * 1e3:.0f} ms, computing "
                f"{s['compute_s'] * 1e3:.0f} ms, in collectives {(s['collectives_s'] or 0) * 1e3:.0f} ms"
            )
    print(f"- {diagnosis}")
    if not args.quick:
        full = {
            core: run_ours(core, args.steps, args.warmup) for core in ("ours-ddp-full", "ours-fsdp")
        }
        print()
        print(
            "Full fine-tuning (no LoRA), our Accelerator, peak RSS per rank (MB) while training / whole rank:"
        )
        for core, (results, peaks) in full.items():
            print(
                f"- {core}: {_mb([r['growth_bytes'] for r in results])} / {_mb(peaks)}; "
                f"step {statistics.median(r['step_s'] for r in results) * 1e3:.1f} ms"
            )
    print(f"\n{time.perf_counter() - began_all:.0f} s in all")


if __name__ == "__main__":
    main()
