"""One launch on the real torch_xla with PJRT_DEVICE=CPU: a rank trains a small model with the
training core and returns a value; a second launch raises, and the error comes back.

Run by tests/test_tpu_real_xla.py (make test-xla) in the .venv-xla environment.
"""

from __future__ import annotations

import json
import os
import sys

from notebook_launcher import RankFailedError, hardware, notebook_launcher


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
