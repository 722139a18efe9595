"""Check the Accelerator's GPU precisions on a CUDA machine with (at least) one GPU.

    PYTHONPATH=. python benchmarks/gpu_check_accelerator.py [--require-fp8]

Runs in one plain process (world size 1). For "bf16", "fp16" and "fp8" it trains a small
model for a few dozen steps and checks that the precision really runs: the dtype inside
the forward, the GradScaler's state for fp16, torchao's float8 layers for fp8. Prints
one PASS/FAIL/SKIP line per check; exits 1 if any check failed. fp8 is skipped (not
failed) when the GPU is older than Hopper/Ada or torchao is missing, unless
--require-fp8 is given. Takes well under 2 minutes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from typing import Any, Callable

import torch

RESULTS: list[tuple[str, str, str]] = []


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


class Skip(Exception):
    pass


class CheckFailed(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def make_task(width: int = 256) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 16),
    )
    x = torch.randn(1024, width)
    y = torch.tanh(x[:, :16] * 2)
    return model, x, y


def train(
    accelerator: Any,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    lr: float = 1e-3,
    clip: bool = False,
) -> tuple[float, float, list[torch.dtype]]:
    from torch.utils.data import DataLoader, TensorDataset

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inner_dtypes: list[torch.dtype] = []
    first_linear = next(
        m
        for m in accelerator.unwrap_model(model).modules()
        if isinstance(m, torch.nn.Linear) or "Float8" in type(m).__name__
    )
    first_linear.register_forward_hook(lambda m, i, o: inner_dtypes.append(o.dtype))
    losses: list[float] = []
    step = 0
    while step < steps:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if clip:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step == steps:
                break
    first = sum(losses[:5]) / 5
    last = sum(losses[-5:]) / 5
    expect(all(math.isfinite(v) for v in losses), f"non-finite losses: {losses[-5:]}")
    expect(last < first * 0.8, f"loss did not fall: first 5 steps {first:.4f}, last 5 {last:.4f}")
    return first, last, inner_dtypes


def check_lazy_cuda() -> str:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    expect(
        accelerator.device == torch.device("cuda", 0),
        f"device is {accelerator.device}, expected cuda:0",
    )
    expect(not torch.cuda.is_initialized(), "creating the Accelerator initialised CUDA")
    return f"device {accelerator.device}, CUDA not initialised before prepare"


def check_bf16() -> str:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    model, x, y = make_task()
    first, last, dtypes = train(accelerator, model, x, y, steps=60)
    expect(dtypes[0] == torch.bfloat16, f"first Linear produced {dtypes[0]}, expected bfloat16")
    expect(accelerator.scaler is None, "bf16 must not use a GradScaler")
    return f"Linear output {dtypes[0]}, loss {first:.4f} -> {last:.4f}"


def check_fp16() -> str:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    expect(
        accelerator.scaler is not None and accelerator.scaler.is_enabled(),
        "fp16 needs an enabled GradScaler",
    )
    model, x, y = make_task()
    first, last, dtypes = train(accelerator, model, x, y, steps=60, clip=True)
    expect(dtypes[0] == torch.float16, f"first Linear produced {dtypes[0]}, expected float16")
    scale = accelerator.scaler.get_scale()
    expect(math.isfinite(scale) and scale > 0, f"loss scale is {scale}")
    return f"Linear output {dtypes[0]}, loss scale {scale:g}, loss {first:.4f} -> {last:.4f}"


def check_fp16_overflow_skips_the_step() -> str:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    scale_before = accelerator.scaler.get_scale()
    loss = model(torch.randn(4, 16, device=accelerator.device)).sum() * float("inf")
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    expect(accelerator.optimizer_step_was_skipped, "an inf gradient did not skip the step")
    expect(
        all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
        "weights changed on an inf step",
    )
    scale_after = accelerator.scaler.get_scale()
    expect(scale_after < scale_before, f"scale did not back off: {scale_before} -> {scale_after}")
    return f"inf gradients: step skipped, scale {scale_before:g} -> {scale_after:g}"


def check_fp8(require: bool) -> str:
    from notebook_launcher.accelerator import (
        Accelerator,
        MissingDependencyError,
        MixedPrecisionError,
    )

    try:
        accelerator = Accelerator(mixed_precision="fp8")
    except MixedPrecisionError as error:
        if require:
            raise
        raise Skip(f"this GPU cannot run fp8 ({error})") from None
    model, x, y = make_task()
    try:
        first, last, _ = train(accelerator, model, x, y, steps=60)
    except MissingDependencyError as error:
        if require:
            raise
        raise Skip(f"torchao is missing: {error}") from None
    float8 = [
        name
        for name, m in accelerator.unwrap_model(model).named_modules()
        if "Float8" in type(m).__name__
    ]
    expect(
        accelerator.fp8_layers == ["0", "2", "4"],
        f"converted layers {accelerator.fp8_layers}, expected all three",
    )
    expect(len(float8) == 3, f"float8 modules in the model: {float8}")
    import torchao

    return (
        f"torchao {torchao.__version__}: layers {float8} in float8, loss {first:.4f} -> {last:.4f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require-fp8", action="store_true", help="fail instead of skipping fp8")
    options = parser.parse_args()
    started = time.perf_counter()
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}", flush=True)
    if torch.version.cuda is None:
        report("FAIL", "cuda", "this torch has no CUDA support")
        return 1
    check("lazy CUDA", check_lazy_cuda)
    name = torch.cuda.get_device_name(0)
    capability = torch.cuda.get_device_capability(0)
    print(f"GPU 0: {name}, compute capability {capability[0]}.{capability[1]}", flush=True)
    check("bf16", check_bf16)
    check("fp16", check_fp16)
    check("fp16 overflow", check_fp16_overflow_skips_the_step)
    check("fp8", lambda: check_fp8(options.require_fp8))
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(
        f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed or skipped, "
        f"{len(failed)} failed, in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
