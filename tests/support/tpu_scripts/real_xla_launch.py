"""Launches on the real torch_xla with PJRT_DEVICE=CPU: a rank trains a small model with the
training core and returns a value; a launch that raises, one whose data set raises, one that
exchanges objects and reduces through torch_xla, one that leaves a loader and a thread behind.

Each prints one line the test reads. Run by tests/tpu/test_tpu_real_xla.py (make test-xla) in the
.venv-xla environment.
"""

from __future__ import annotations

import json
import os
import sys

from xla_cases import exchange_objects, leave_things_running, read_flaky_data  # this directory

from notebook_launcher import LaunchTimeoutError, RankFailedError, hardware, notebook_launcher


def train(steps: int) -> dict:
    import torch
    import torch_xla
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_launcher import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(4, 1)
    model, opt, loader = acc.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05), DataLoader(data, batch_size=8)
    )
    losses = []
    for _ in range(steps):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    acc.print(f"trained on {acc.device}, first loss {losses[0]:.4f}, last {losses[-1]:.4f}")
    return {
        "torch_xla": torch_xla.__version__,
        "device": str(acc.device),
        "device_type": str(next(model.parameters()).device.type),
        "distributed_type": acc.distributed_type.value,
        "mixed_precision": acc.mixed_precision,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "gathered": acc.gather_for_metrics(torch.tensor([1.0, 2.0], device=acc.device)).tolist(),
    }


def fail() -> None:
    import torch
    import torch_xla

    torch.ones(2, device=torch_xla.device()).sum().item()
    raise KeyError("the XLA rank raised this on purpose")


if __name__ == "__main__":
    report = hardware.detect()
    print("report:", report.tpu.describe() if report.tpu else None, flush=True)
    result = notebook_launcher(train, args=(3,), hardware="tpu")
    print("value:", json.dumps(result, sort_keys=True), flush=True)
    bf16 = notebook_launcher(train, args=(1,), hardware="tpu", mixed_precision="bf16")
    print("bf16 value:", json.dumps(bf16, sort_keys=True), flush=True)
    try:
        notebook_launcher(fail, hardware="tpu")
    except RankFailedError as error:
        print("error type:", type(error).__name__, "is KeyError:", isinstance(error, KeyError))
        print("error:", error)
    else:
        sys.exit("the failing launch did not raise")
    print("kernel environment unchanged:", "TPU_PROCESS_ADDRESSES" not in os.environ)
    try:
        batches = notebook_launcher(read_flaky_data, hardware="tpu")
    except RankFailedError as error:
        print(
            "data error:",
            json.dumps(
                {
                    "type": type(error).__name__,
                    "is ValueError": isinstance(error, ValueError),
                    "message": str(error),
                }
            ),
        )
    else:
        print("data error:", json.dumps({"returned": batches}))
    try:
        objects = notebook_launcher(exchange_objects, hardware="tpu")
    except RankFailedError as error:
        objects = {"failed": str(error).splitlines()[0]}
    print("objects:", json.dumps(objects), flush=True)
    try:
        left = notebook_launcher(leave_things_running, hardware="tpu", timeout=180)
    except LaunchTimeoutError as error:
        left = {"timed out": str(error).splitlines()[0]}
    print("left behind:", json.dumps(left), flush=True)
