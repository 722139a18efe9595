"""Run on 2 ranks under torchrun by tests/accelerator/test_accelerator_multirank.py.

Every check's result goes into one file per rank (results_rank<r>.pt in the directory
given as argv[1]); the tests compare those with single-process references. Batched into
one script because each torchrun start costs several seconds here.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
import common

from notebook_launcher.accelerator import (
    Accelerator,
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
)

OUT = Path(sys.argv[1])
results: dict[str, Any] = {}


def record(name: str, value: Any) -> None:
    results[name] = value


def check_identity(acc: Accelerator) -> None:
    record(
        "identity",
        {
            "process_index": acc.process_index,
            "local_process_index": acc.local_process_index,
            "num_processes": acc.num_processes,
            "is_main_process": acc.is_main_process,
            "device": str(acc.device),
            "distributed_type": acc.distributed_type.value,
            "env_precision": acc.mixed_precision,  # from ACCELERATE_MIXED_PRECISION=bf16
        },
    )


def check_parity(acc_factory: Any, name: str, batch_size: int) -> None:
    acc = acc_factory()
    trained = common.train_with_accelerator(acc, batch_size=batch_size)
    model = trained.pop("model")
    with torch.no_grad():
        trained["probe_output"] = model(common.probe().to(acc.device)).cpu()
    trained["parameter_type"] = type(next(model.parameters())).__name__
    state = acc.get_state_dict(model)  # a collective under FSDP2: every rank calls it
    acc.save(state, OUT / f"{name}.pt")
    record(name, trained)


class Numbers(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(torch.arange(self.n, dtype=torch.float32).unsqueeze(1))


def gathered_predictions(acc: Accelerator, loader: DataLoader) -> tuple[list[float], list[int]]:  # type: ignore[type-arg]
    loader = acc.prepare(loader)
    predictions: list[float] = []
    objects: list[int] = []
    for (x,) in (
        loader if not isinstance(loader.dataset, IterableDataset) else ((b,) for b in loader)
    ):
        predictions += acc.gather_for_metrics(x[:, 0] * 1.0).tolist()
        objects += acc.gather_for_metrics([int(v) for v in x[:, 0]], use_gather_object=True)
    return predictions, objects


def check_gather_for_metrics(acc: Accelerator) -> None:
    numbers = TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1))
    record("metrics_batches", gathered_predictions(acc, DataLoader(numbers, batch_size=3)))
    split = Accelerator(
        mixed_precision="no", dataloader_config=DataLoaderConfiguration(split_batches=True)
    )
    record("metrics_split", gathered_predictions(split, DataLoader(numbers, batch_size=4)))
    record("metrics_iterable", gathered_predictions(acc, DataLoader(Numbers(10), batch_size=3)))


def check_seedable_sampler() -> None:
    acc = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    )
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True))
    epochs = []
    for _ in range(2):
        epochs.append([int(i) for (batch,) in loader for i in batch])
    record("seedable", epochs)
    plain = Accelerator()
    shuffled = plain.prepare(
        DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)
    )
    record("shuffled_shard", [int(i) for (batch,) in shuffled for i in batch])


def check_collectives(acc: Accelerator) -> None:
    rank = acc.process_index
    padded = acc.pad_across_processes(torch.full((rank + 1, 2), rank + 1.0), dim=0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        acc.print("only once")
    with acc.split_between_processes([0, 1, 2, 3, 4]) as mine:
        share = list(mine)
    with acc.split_between_processes([0, 1, 2, 3, 4], apply_padding=True) as mine:
        padded_share = list(mine)
    with acc.split_between_processes({"a": [1, 2], "b": ["x", "y"]}) as mine:
        dict_share = dict(mine)
    order_file = OUT / "order.txt"
    with acc.main_process_first():
        if acc.is_main_process:
            time.sleep(0.5)  # a slow first process must still come first
        with open(order_file, "a") as f:
            f.write(f"{rank}\n")
    acc.wait_for_everyone()
    record(
        "collectives",
        {
            "gather": acc.gather(torch.tensor([rank, rank * 10])).tolist(),
            "gather_scalar": acc.gather(torch.tensor(rank + 0.5)).tolist(),
            "gather_nested": {
                k: v.tolist() for k, v in acc.gather({"a": torch.tensor([rank])}).items()
            },
            "reduce_sum": acc.reduce(torch.tensor([rank + 1.0])).tolist(),
            "reduce_mean": acc.reduce(torch.tensor([rank + 1.0]), reduction="mean").tolist(),
            "padded_shape": list(padded.shape),
            "gathered_padded": acc.gather(padded).tolist(),
            "printed": out.getvalue(),
            "share": share,
            "padded_share": padded_share,
            "dict_share": dict_share,
            "order": order_file.read_text().split(),
            "on_main": acc.on_main_process(lambda: "ran")(),
        },
    )


def check_bf16() -> None:
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(common.make_model())
    dtypes: list[torch.dtype] = []
    inner = acc.unwrap_model(model)
    inner[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    output = model(torch.randn(4, common.FEATURES))
    with acc.autocast():
        plain = torch.nn.Linear(3, 3)(torch.randn(2, 3)).dtype
    record(
        "bf16",
        {
            "inner_linear": str(dtypes[0]),
            "output": str(output.dtype),
            "autocast_block": str(plain),
            "type": type(model).__name__,
        },
    )


def check_hf_accelerate() -> None:
    from accelerate import Accelerator as HFAccelerator

    # What notebook_launcher sets in a CPU rank; under plain torchrun accelerate would
    # otherwise look for a GPU and fall back to a single process.
    os.environ["ACCELERATE_USE_CPU"] = "true"
    hf = HFAccelerator()
    record(
        "hf_accelerate",
        {
            "num_processes": hf.num_processes,
            "process_index": hf.process_index,
            "mixed_precision": hf.mixed_precision,
            "device": str(hf.device),
        },
    )


def main() -> None:
    acc = Accelerator(mixed_precision="no")
    check_identity(Accelerator())
    check_parity(lambda: Accelerator(mixed_precision="no"), "ddp", batch_size=4)
    check_parity(
        lambda: Accelerator(mixed_precision="no", gradient_accumulation_steps=2),
        "ddp_accum",
        batch_size=4,
    )
    check_parity(
        lambda: Accelerator(mixed_precision="no", fsdp_plugin=FullyShardedDataParallelPlugin()),
        "fsdp",
        batch_size=4,
    )
    check_gather_for_metrics(acc)
    check_seedable_sampler()
    check_collectives(acc)
    check_bf16()
    check_hf_accelerate()
    torch.save(results, OUT / f"results_rank{acc.process_index}.pt")
    acc.wait_for_everyone()
    acc.end_training()
    record("group_destroyed", not torch.distributed.is_initialized())
    torch.save(results, OUT / f"results_rank{acc.process_index}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
