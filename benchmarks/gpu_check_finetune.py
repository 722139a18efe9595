"""Check fine-tuning on a CUDA machine with one or two GPUs: QLoRA and bf16 LoRA (fp16 on
GPUs without bf16, such as Kaggle's T4).

    PYTHONPATH=. python benchmarks/gpu_check_finetune.py [--steps 30]

Needs peft, transformers, accelerate, and bitsandbytes for QLoRA. Builds a small Llama
from a config (no download; hidden 1024, 8 layers), then:

- QLoRA: the base quantised to 4-bit NF4 by bitsandbytes, LoRA adapters in bf16 on top,
  trained in a launch on one GPU and, where there are two, on two (DDP). Checks that the
  base's linear layers are bitsandbytes 4-bit layers, that only the adapters train, that
  the loss falls, and that the two ranks end with the same adapter.
- bf16 LoRA: the same model in bf16 with LoRA, through our Accelerator in
  ``notebook_launcher`` and through accelerate's Accelerator under ``torchrun``, in one
  run: median step time and each rank's ``max_memory_allocated`` side by side, and how
  far apart the final adapters are (bf16 reductions may differ in order: compared within
  a tolerance, said so).

Prints one PASS/FAIL/SKIP line per check and a small table; exits 1 if a check failed.
Takes a few minutes.
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
import traceback
from typing import Any, Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS: list[tuple[str, str, str]] = []
HIDDEN, LAYERS, VOCAB, LENGTH, BATCH = 1024, 8, 8192, 256, 4


class Skip(Exception):
    pass


def report(status: str, name: str, detail: str) -> None:
    RESULTS.append((status, name, detail))
    print(f"{status} {name}: {detail}", flush=True)


def check(name: str, function: Callable[[], str]) -> None:
    try:
        report("PASS", name, function())
    except Skip as skip:
        report("SKIP", name, str(skip))
    except Exception as error:  # a failed check must not stop the others
        report("FAIL", name, f"{type(error).__name__}: {error}")
        traceback.print_exc()


def precision() -> str:
    """bf16 where the GPU has it (Ampere and later), else fp16 (T4, V100): set by main()."""
    return os.environ.get("GPU_CHECK_PRECISION", "bf16")


def dtype() -> torch.dtype:
    return torch.bfloat16 if precision() == "bf16" else torch.float16


def build(quantized: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=LENGTH,
        torch_dtype="bfloat16" if precision() == "bf16" else "float16",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype())
    if quantized:
        model = _quantize(model)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    return get_peft_model(model, lora)


def _quantize(model: torch.nn.Module) -> torch.nn.Module:
    """Every linear layer of the blocks replaced by a bitsandbytes NF4 layer (on the GPU)."""
    import bitsandbytes as bnb

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and "layers." in f"{name}.{child_name}":
                quantized = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None,
                    compute_dtype=dtype(), quant_type="nf4",
                )  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(
                    child.weight.data.cpu(), requires_grad=False, quant_type="nf4"
                )
                setattr(module, child_name, quantized)
    return model


def train(core: str, quantized: bool, steps: int) -> dict[str, Any]:
    """One rank: ``core`` is "ours" or "accelerate"."""
    if core == "accelerate":
        from accelerate import Accelerator

        accelerator: Any = Accelerator(mixed_precision=precision())
    else:
        from notebook_launcher import Accelerator as Ours

        accelerator = Ours(mixed_precision=precision())
    model = build(quantized)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(
        0, VOCAB, (BATCH * accelerator.num_processes * steps, LENGTH), generator=generator
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in loader:
        torch.cuda.synchronize()
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        losses.append(loss.item())
    unwrapped = accelerator.unwrap_model(model)
    four_bit = sum(type(m).__name__ == "Linear4bit" for m in unwrapped.modules())
    return {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "step_s": statistics.median(times[3:]),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "losses": losses,
        "four_bit_layers": four_bit,
        "trainable_only_lora": all(
            "lora_" in n for n, p in unwrapped.named_parameters() if p.requires_grad
        ),
        "adapter": {k: v.float().cpu() for k, v in unwrapped.state_dict().items() if "lora_" in k},
    }


def _launch(core: str, quantized: bool, gpus: int, steps: int) -> list[dict[str, Any]]:
    from notebook_launcher import notebook_launcher

    return notebook_launcher(
        train,
        args=(core, quantized, steps),
        num_processes=gpus,
        mixed_precision=precision(),
        return_all=True,
        output="none",
    )


def qlora(gpus: int, steps: int) -> str:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise Skip(f"bitsandbytes is not installed ({error})") from error
    results = _launch("ours", True, gpus, steps)
    first = results[0]
    if first["four_bit_layers"] < LAYERS * 7:
        raise AssertionError(f"only {first['four_bit_layers']} 4-bit layers")
    if not first["trainable_only_lora"]:
        raise AssertionError("parameters other than LoRA's train")
    if not statistics.mean(first["losses"][-5:]) < statistics.mean(first["losses"][:5]):
        raise AssertionError(f"the loss did not fall: {first['losses']}")
    if gpus > 1:
        for name, value in first["adapter"].items():
            if not torch.equal(value, results[1]["adapter"][name]):
                raise AssertionError(f"ranks disagree on {name}")
    peaks = ", ".join(f"{r['max_memory_allocated'] / 2**30:.2f} GiB" for r in results)
    return f"{gpus} GPU(s): {first['four_bit_layers']} NF4 layers, loss {first['losses'][0]:.3f} -> {first['losses'][-1]:.3f}, step {first['step_s'] * 1e3:.0f} ms, peak per rank {peaks}"


def _torchrun(gpus: int, steps: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--master-addr=127.0.0.1",
             f"--master-port={port}", __file__, "--worker", out, "--steps", str(steps)],
            env={**os.environ, "PYTHONPATH": REPO}, check=True,
        )  # fmt: skip
        return [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(gpus)]


def bf16_side_by_side(gpus: int, steps: int) -> str:
    ours = _launch("ours", False, gpus, steps)
    theirs = _torchrun(gpus, steps)
    worst = max(
        (ours[0]["adapter"][k] - v).abs().max().item() for k, v in theirs[0]["adapter"].items()
    )
    print("| | step time (median) | max_memory_allocated per rank |")
    print("|---|---|---|")
    for label, results in (
        ("notebook_launcher + our Accelerator", ours),
        ("torchrun + accelerate", theirs),
    ):
        memory = " / ".join(f"{r['max_memory_allocated'] / 2**30:.2f} GiB" for r in results)
        print(f"| {label} | {results[0]['step_s'] * 1e3:.1f} ms | {memory} |")
    ratio = ours[0]["step_s"] / theirs[0]["step_s"]
    if worst > 1e-2:
        raise AssertionError(f"final adapters differ by up to {worst:.3g}")
    return f"step time ratio ours/accelerate {ratio:.2f}; final adapters within {worst:.2g} (bf16)"


def worker(out: str, steps: int) -> None:
    import torch.distributed as dist

    result = train("accelerate", False, steps)
    torch.save(result, f"{out}/rank{result['rank']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA GPU")
        return 0
    gpus = min(2, torch.cuda.device_count())
    # T4 and V100 have no bf16: QLoRA and LoRA run in fp16 there (adapters in float32, as
    # peft keeps them and as prepare() requires under fp16).
    major = torch.cuda.get_device_capability(0)[0]
    os.environ["GPU_CHECK_PRECISION"] = "bf16" if major >= 8 else "fp16"
    print(f"precision: {precision()} (compute capability {major}.x)")
    check("QLoRA on one GPU", lambda: qlora(1, args.steps))
    if gpus > 1:
        check("QLoRA on two GPUs", lambda: qlora(2, args.steps))
    check(
        f"bf16 LoRA, ours vs accelerate ({gpus} GPU(s))",
        lambda: bf16_side_by_side(gpus, args.steps),
    )
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed or skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
