"""Functions the TPU tests launch both on the real torch_xla (on the CPU, one replica) and on
the fake one (several replicas): each shows what a user gets from the training core on XLA."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher import Accelerator
from notebook_launcher.accelerator import CollectiveError, DataLoaderConfiguration


@dataclasses.dataclass
class Score:
    name: str
    value: float


class FlakyData(torch.utils.data.Dataset):
    """Sample 20 cannot be read: in one process, the 6th of 8 batches of 4 raises."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 20:
            raise ValueError(f"sample {index} is corrupt")
        return torch.tensor([float(index)])


def read_flaky_data() -> int:
    acc = Accelerator()
    loader = acc.prepare(DataLoader(FlakyData(), batch_size=4))
    batches = 0
    for _ in loader:
        batches += 1
    print(f"the epoch ended after {batches} batches", flush=True)
    return batches


def exchange_objects() -> dict[str, Any]:
    """What torch_xla carries for the core's object collectives: numpy values, dataclasses."""
    import numpy as np

    from notebook_launcher.accelerator import xla

    acc = Accelerator()
    rank = acc.process_index
    # Asked of torch_xla directly: with one replica the core itself would exchange nothing.
    gathered = xla.gather_object([np.float64(rank), np.arange(3), Score("accuracy", 0.75)])
    sent = xla.broadcast_object_list([Score(f"lr of {rank}", 0.1), np.int64(7)], 0)
    on_device = xla.gather_object({"t": torch.arange(3.0, device=acc.device)})[0]["t"]
    reduced = {
        kind: xla.all_reduce(torch.tensor([3.0, -1.0], device=acc.device), kind).cpu().tolist()
        for kind in ("sum", "mean", "max", "min")
    }
    try:
        xla.gather_object(threading.Lock())
        refused = ""
    except CollectiveError as error:
        refused = str(error)
    model = torch.nn.Linear(3, 1).to(acc.device)
    before = model.weight.detach().cpu().clone()
    xla.broadcast_module(model)  # replica 0 keeps its own weights
    kept = bool(torch.equal(model.weight.detach().cpu(), before))
    return {
        "gathered": repr(gathered),
        "sent": repr(sent),
        "reduced": reduced,
        "broadcast kept": kept,
        "tensor in an object": [str(on_device.device), on_device.tolist()],
        "refused": refused,
    }


def gather_a_lock(bad_rank: int) -> list[Any]:
    """One replica passes what cannot be pickled; the others wait for it in the exchange."""
    acc = Accelerator()
    mine: Any = threading.Lock() if acc.process_index == bad_rank else acc.process_index
    from notebook_launcher.accelerator import xla

    return xla.gather_object(mine)


def leave_things_running() -> dict[str, Any]:
    """Leave a prepared loader early, then return with a thread still running."""
    acc = Accelerator()
    data = TensorDataset(torch.arange(400.0).reshape(200, 2))
    loader = acc.prepare(DataLoader(data, batch_size=2, num_workers=2))
    for step, _ in enumerate(loader):
        if step == 2:
            break
    loader_threads = [t.name for t in threading.enumerate() if "_worker)" in t.name]
    workers = len(multiprocessing.active_children())
    never = threading.Event()
    threading.Thread(target=never.wait, name="left running", daemon=False).start()
    return {"loader_threads": loader_threads, "loader_workers": workers}


def as_scores(samples: list[int]) -> list[Score]:
    return [Score(f"s{i}", float(i)) for i in samples]


def collectives() -> dict[str, Any]:
    """The core's collectives across replicas, as a user calls them."""
    import numpy as np

    from notebook_launcher.accelerator import operations

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    rank = acc.process_index
    mine = torch.tensor([float(rank + 1)], device=acc.device)
    reduced = {
        kind: acc.reduce(mine, kind).cpu().tolist() for kind in ("sum", "mean", "max", "min")
    }
    objects = acc.gather_for_metrics(
        [np.float64(rank), Score(f"r{rank}", rank)], use_gather_object=True
    )
    sent = operations.broadcast_object_list([Score(f"from {rank}", rank)], from_process=1)
    loader = acc.prepare(DataLoader(list(range(16)), batch_size=2, collate_fn=as_scores))
    dispatched = [score.name for batch in loader for score in batch]
    return {
        "reduced": reduced,
        "objects": repr(objects),
        "sent": repr(sent),
        "dispatched": dispatched,
    }


def dispatched_samples() -> list[str]:
    """``dispatch_batches``: replica 0 reads; each replica gets its part of every global batch."""
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare(DataLoader(list(range(32)), batch_size=2, collate_fn=as_scores))
    return [score.name for batch in loader for score in batch]


def seeded_model(draws: int) -> torch.nn.Module:
    torch.manual_seed(0)
    torch.rand(draws)  # what another thread of the process drew from the shared RNG meanwhile
    return torch.nn.Linear(4, 1)


def train_a_seeded_model() -> list[list[float]]:
    """Replicas whose seeded model starts apart (threads of one process share torch's RNG)."""
    import torch_xla.runtime as xr

    acc = Accelerator()
    model = seeded_model(xr.global_ordinal() % 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.full((2, 4), float(acc.process_index), device=acc.device)
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return acc.gather(model.weight.detach()).cpu().tolist()


def clip_data(replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two samples per replica; the replicas' gradients differ a lot in size."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * replicas, 4, generator=g)
    y = torch.arange(2 * replicas, dtype=torch.float32).pow(2)[:, None]
    return x, y


def clipped_step() -> dict[str, Any]:
    acc = Accelerator()
    rank, replicas = acc.process_index, acc.num_processes
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = clip_data(replicas)
    x, y = x[2 * rank : 2 * rank + 2].to(acc.device), y[2 * rank : 2 * rank + 2].to(acc.device)
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
    weight = model.weight.detach().cpu().tolist()
    opt.zero_grad()
    # Clipped, then dropped without a step: the next step must average its own gradients.
    acc.backward(model(x).sum())
    acc.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.zero_grad()
    acc.backward(model(x).pow(2).sum())
    opt.step()
    everyone = acc.gather(model.weight.detach()).cpu()
    return {"norm": float(norm), "weight": weight, "agree": bool((everyone == everyone[0]).all())}


def clipped_step_in_one_process(replicas: int) -> dict[str, Any]:
    """The same step as ``clipped_step`` on every replica's data at once, in plain PyTorch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = clip_data(replicas)
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"norm": float(norm), "weight": model.weight.detach().tolist()}


def variables_added_while_training() -> list[str]:
    """Names a replica saw added to the environment during a training step (see the test)."""
    before = set(os.environ)
    train_a_seeded_model()
    return sorted(set(os.environ) - before)
