"""The launcher's CUDA paths, checked on a machine with NVIDIA GPUs.

Prints one PASS/FAIL line per check and exits non-zero if any failed. Needs no GPU-less
fallback: run it where `nvidia-smi` lists at least one GPU.

    python benchmarks/gpu_check_launcher.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from typing import Callable

from notebook_launcher import LaunchConfigError, RankFailedError, hardware, notebook_launcher

failures: list[str] = []


def check(name: str, body: Callable[[], str]) -> None:
    try:
        detail = body()
    except Exception:
        failures.append(name)
        print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    else:
        print(f"PASS {name}: {detail}", flush=True)


def cuda_job(scale: float) -> tuple[int, int, str, float, str]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    value = torch.full((1,), float(dist.get_rank() + 1), device="cuda") * scale
    dist.all_reduce(value)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        product = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    seen = (
        dist.get_rank(),
        torch.cuda.current_device(),
        torch.cuda.get_device_name(),
        value.item(),
        str(product.dtype),
    )
    dist.destroy_process_group()
    return seen


def train_with_core(steps: int) -> tuple[str, str, str, float]:
    """A launched rank using the training core with the launcher's precision."""
    import torch

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs = torch.randn(64, 256, device=accelerator.device)
    targets = torch.randn(64, 16, device=accelerator.device)
    inner: list[str] = []  # the prepared model returns fp32; autocast shows inside it
    accelerator.unwrap_model(model)[2].register_forward_hook(
        lambda m, i, o: inner.append(str(o.dtype))
    )
    for _ in range(steps):
        outputs = model(inputs)
        loss = torch.nn.functional.mse_loss(outputs.float(), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return str(accelerator.device), accelerator.mixed_precision, inner[-1], float(loss.item())


def main() -> int:
    import torch

    report = hardware.detect()
    gpus = len(report.gpus)

    def detection() -> str:
        assert gpus >= 1, "nvidia-smi lists no GPU"
        assert not torch.cuda.is_initialized(), "detection initialised CUDA"
        assert report.accelerator == "cuda" and report.default_num_processes == gpus
        return ", ".join(
            f"{g.name} {g.memory_mib} MiB cc {g.compute_capability}" for g in report.gpus
        )

    def one_rank_per_gpu_by_default() -> str:
        values = notebook_launcher(cuda_job, (1.0,), return_all=True, mixed_precision="bf16")
        assert [v[:2] for v in values] == [(r, r) for r in range(gpus)], values
        assert all(v[3] == gpus * (gpus + 1) / 2 for v in values), values
        assert values[0][4] == "torch.bfloat16"
        return f"{len(values)} rank(s), fork, nccl all_reduce ok, {values[0][2]}"

    def precisions_accepted_on_this_gpu() -> str:
        supported = [p for p, why in hardware.precision_support(report).items() if why is None]
        for precision in supported:
            seen = notebook_launcher(
                lambda: os.environ["ACCELERATE_MIXED_PRECISION"],
                num_processes=1,
                mixed_precision=precision,
                output="none",
            )
            assert seen == precision
        return "accepted: " + ", ".join(supported)

    def too_many_ranks_refused() -> str:
        try:
            notebook_launcher(cuda_job, (1.0,), num_processes=gpus + 1)
        except LaunchConfigError as error:
            return str(error)[:90]
        raise AssertionError("more ranks than GPUs was accepted")

    def failure_in_a_cuda_rank() -> str:
        def fail() -> None:
            import torch

            torch.zeros(1, device="cuda")
            raise ValueError("bad batch on the GPU")

        try:
            notebook_launcher(fail, num_processes=1)
        except ValueError as error:
            assert isinstance(error, RankFailedError)
            return str(error).splitlines()[0]
        raise AssertionError("the failure did not surface")

    def forkserver_after_cuda_init() -> str:
        torch.zeros(1, device="cuda")  # CUDA is now initialised in this "kernel"
        assert torch.cuda.is_initialized()
        try:
            notebook_launcher(cuda_job, (1.0,), start_method="fork")
        except LaunchConfigError as error:
            refused = "CUDA was initialised in this kernel" in str(error)
        else:
            refused = False
        assert refused, "fork after CUDA init was not refused"
        first = time.perf_counter()
        values = notebook_launcher(cuda_job, (2.0,), return_all=True)
        first = time.perf_counter() - first
        assert all(v[3] == 2.0 * gpus * (gpus + 1) / 2 for v in values), values
        warm = []
        for _ in range(5):
            started = time.perf_counter()
            notebook_launcher(cuda_job, (1.0,), output="none")
            warm.append(time.perf_counter() - started)
        return (
            f"auto chose the forkserver; first launch {first:.2f}s, warm re-launch median "
            f"{statistics.median(warm) * 1e3:.0f} ms (nccl init included)"
        )

    def core_in_launched_ranks() -> str:
        import importlib.util
        import math

        precisions = ["bf16", "fp16"]
        if hardware.precision_support(report)["fp8"] is None and importlib.util.find_spec(
            "torchao"
        ):
            precisions.append("fp8")
        seen = []
        for precision in precisions:
            values = notebook_launcher(
                train_with_core, (20,), mixed_precision=precision, return_all=True, output="none"
            )
            for rank, (device, used, dtype, loss) in enumerate(values):
                assert device == f"cuda:{rank}" and used == precision, values
                assert math.isfinite(loss), values
                expected = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(precision, dtype)
                assert dtype == expected, f"{precision} ran with {dtype} outputs"
            seen.append(
                f"{precision}: last Linear computes in {values[0][2]}, loss {values[0][3]:.3f}"
            )
        return "; ".join(seen)

    for name, body in [
        ("GPUs found without initialising CUDA", detection),
        ("one rank per GPU by default, each on cuda:LOCAL_RANK", one_rank_per_gpu_by_default),
        (
            "precisions this GPU supports are accepted and reach the ranks",
            precisions_accepted_on_this_gpu,
        ),
        ("more ranks than GPUs is refused", too_many_ranks_refused),
        ("an exception in a CUDA rank surfaces with its type", failure_in_a_cuda_rank),
        (
            "the training core in launched CUDA ranks runs the launch's precision",
            core_in_launched_ranks,
        ),
        (
            "after CUDA init in the caller: fork refused, auto uses the warm forkserver",
            forkserver_after_cuda_init,
        ),
    ]:
        check(name, body)
    print(f"{'FAILED: ' + ', '.join(failures) if failures else 'ALL PASSED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
