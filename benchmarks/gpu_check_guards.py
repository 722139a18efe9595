"""Check the GPU guards on a CUDA machine: each guard's detection against the real hardware.

- compute capability against torch's built architecture list (what would be refused);
- peer-to-peer access, probed in a subprocess (the notebook's process never starts CUDA), and
  /dev/shm measured, with the NCCL variables a launch would set;
- a 2-GPU launch that trains a tiny DDP model after those settings (NCCL really works);
- under fp16, a trainable float16 parameter refused in prepare(), in a launch;
- a device map over two GPUs refused in prepare() of a 2-rank launch (the model really
  spread by device_map="auto" when transformers and accelerate are installed, else by hand).

    python benchmarks/gpu_check_guards.py
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str) -> None:
    RESULTS.append((status, name, detail))
    print(f"{status:4} {name}: {detail}", flush=True)


def check(name: str, run: Callable[[], str]) -> None:
    try:
        report("OK", name, run())
    except Exception as error:  # a failed check must not stop the others
        report("FAIL", name, f"{type(error).__name__}: {error}")
        traceback.print_exc()


def architectures() -> str:
    from notebook_launcher import gpu_guards, hardware

    report_ = hardware.detect()
    arch_list = gpu_guards.torch_arch_list()
    usable = gpu_guards.usable_gpus(report_.gpus)
    gpus = ", ".join(
        f"{g.index}: {g.name} sm {g.compute_capability} {'ok' if usable[g.index] else 'REFUSED'}"
        for g in report_.gpus
    )
    gpu_guards.check_architectures(report_.gpus, arch_list, report_.torch_version)
    return f"torch built for {arch_list}; {gpus}"


def nccl() -> str:
    from notebook_launcher import gpu_guards, hardware

    count = len(hardware.detect().gpus)
    failed = gpu_guards.probe_peer_access(os.environ.get("CUDA_VISIBLE_DEVICES"))
    shm = gpu_guards.shm_size()
    settings = gpu_guards.nccl_settings(count, os.environ, failed, shm)
    import torch

    assert not torch.cuda.is_initialized(), "the probe started CUDA in this process"
    return f"{count} GPUs, failed peer pairs {failed}, /dev/shm {shm}, would set {dict(settings.environ)}"


def ddp_step() -> Any:
    import torch

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(5):
        accelerator.backward(model(torch.randn(8, 64, device=accelerator.device)).sum())
        optimizer.step()
        optimizer.zero_grad()
    return {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")}


def two_gpu_launch() -> str:
    from notebook_launcher import notebook_launcher

    seen = notebook_launcher(ddp_step, num_processes=2, return_all=True, output="none")
    return f"5 DDP steps on 2 GPUs; NCCL variables in the ranks: {seen}"


def fp16_parameter() -> None:
    import torch

    from notebook_launcher import Accelerator

    Accelerator(mixed_precision="fp16").prepare(torch.nn.Linear(8, 8).half())


def fp16_guard() -> str:
    from notebook_launcher import notebook_launcher
    from notebook_launcher.errors import MixedPrecisionError

    try:
        notebook_launcher(fp16_parameter, num_processes=1, mixed_precision="fp16", output="none")
    except MixedPrecisionError as error:
        return str(error).split(". ")[0]
    raise AssertionError("a trainable float16 parameter was not refused")


def spread() -> None:
    import torch

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2))
        from accelerate import dispatch_model

        model = dispatch_model(model, {"transformer.h.0": 0, "transformer.h.1": 1, "": 0})
    except ImportError:
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 4).to("cuda:0"), torch.nn.Linear(4, 4).to("cuda:1")
        )
    accelerator.prepare(model)


def device_map_guard() -> str:
    from notebook_launcher import notebook_launcher
    from notebook_launcher.errors import BigModelError

    try:
        notebook_launcher(spread, num_processes=2, output="none")
    except BigModelError as error:
        return str(error).split(":")[1].strip()
    raise AssertionError("a model spread over two GPUs was not refused")


def main() -> int:
    import shutil

    if shutil.which("nvidia-smi") is None:
        print("SKIP all: no nvidia-smi")
        return 0
    check("compute capability against torch's architectures", architectures)
    check("peer access probe and /dev/shm", nccl)
    from notebook_launcher import hardware

    if len(hardware.detect().gpus) >= 2:
        check("a 2-GPU DDP launch with those settings", two_gpu_launch)
        check("device map over two GPUs refused in a 2-rank launch", device_map_guard)
    check("trainable float16 parameter refused under fp16", fp16_guard)
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
