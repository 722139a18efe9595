"""The training core under torch_xla's own xmp.spawn (fake torch_xla: CPU devices, gloo).

Usage: core_on_xla.py OUT_DIR MIXED_PRECISION. Each replica writes what it saw to
OUT_DIR/replica<N>.pt (xmp.spawn returns nothing), rank 0 also its checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch_xla._fake as fake
import torch_xla.distributed.xla_multiprocessing as xmp
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher import Accelerator

FEATURES, SAMPLES, BATCH = 4, 20, 3  # 20 samples over 2 replicas of 3: the last step repeats


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(SAMPLES))


def model() -> torch.nn.Module:
    # A local generator, so replica 0 starts exactly as the one-process reference does (v2/v3
    # replicas are threads sharing the global RNG; that the core then broadcasts replica 0's
    # weights is tested in test_tpu_xla_core.py).
    g = torch.Generator().manual_seed(1)
    net = torch.nn.Linear(FEATURES, 1)
    with torch.no_grad():
        net.weight.copy_(torch.randn(1, FEATURES, generator=g))
        net.bias.copy_(torch.randn(1, generator=g))
    return net


def train(index: int, out: str, precision: str) -> None:
    acc = Accelerator(mixed_precision=precision)
    net = model()
    net, opt, loader = acc.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(dataset(), batch_size=BATCH)
    )
    seen = []
    for x, y, ids in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        seen.append(acc.gather_for_metrics(ids))
    acc.wait_for_everyone()
    acc.save(acc.get_state_dict(net), Path(out) / "checkpoint.pt")
    acc.print("printed once, by the main process")
    record = {
        "index": index,
        "rank": acc.process_index,
        "world": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "mixed_precision": acc.mixed_precision,
        "device": str(acc.device),
        "weight": net.weight.detach().clone(),
        "seen": torch.cat(seen).tolist(),
        "objects": acc.gather_for_metrics([f"r{acc.process_index}"], use_gather_object=True),
        "reduced": acc.reduce(torch.tensor([float(acc.process_index + 1)])).item(),
        "calls": dict(fake.calls),
    }
    torch.save(record, Path(out) / f"replica{index}.pt")


def reference_weight() -> torch.Tensor:
    """One process, raw PyTorch, with the global batch (2 replicas x 3) and the same repeats."""
    net, data = model(), dataset()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    order = [*range(SAMPLES), 0, 1, 2, 3]  # even_batches pads the last global batch
    for start in range(0, len(order), 2 * BATCH):
        ids = order[start : start + 2 * BATCH]
        x, y, _ = data[ids]
        # Each replica's mean over its 3 samples, averaged: the same as the mean over 6.
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return net.weight.detach()


if __name__ == "__main__":
    out_dir, mixed_precision = sys.argv[1], sys.argv[2]
    xmp.spawn(train, args=(out_dir, mixed_precision), start_method="fork")
    torch.save(reference_weight(), Path(out_dir) / "reference.pt")
