"""accelerate-compatible behaviour that needs 2 CPU ranks, launched by notebook_launcher.

Resuming mid-epoch, gathering mixed batches, shape checks before gathering, max/min
reductions, dispatched batches and fp16 on CPU ranks. The rank functions live in this
module and travel to the ranks by value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from notebook_launcher.errors import CollectiveError
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def launch(function: Any, *args: Any) -> list[Any]:
    return notebook_launcher(  # type: ignore[no-any-return]
        function, args=args, num_processes=2, hardware="cpu", timeout=240, return_all=True
    )


# ---- resuming --------------------------------------------------------------------------------
def resumable_run(folder: str, mode: str) -> dict[str, torch.Tensor]:
    """mode: "full" (3 epochs), "stop" (save after batch 4 of epoch 1), "resume" (from the save).

    Batch 4 of an epoch is the middle of a 2-step accumulation cycle: the gradients of
    that batch are held, not yet applied, when the run stops.
    """
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_launcher.accelerator import Accelerator, set_seed

    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0 if mode != "resume" else 1234)  # a resumed run takes everything from the save
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(37, 3, generator=generator), torch.randn(37, 1, generator=generator)
    )
    loader = DataLoader(data, batch_size=3, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    first_epoch, skip = 0, 0
    if mode == "resume":
        accelerator.load_state(folder)
        first_epoch, skip = 1, 5
    for epoch in range(first_epoch, 3):
        active = accelerator.skip_first_batches(loader, skip) if epoch == first_epoch else loader
        for i, (x, y) in enumerate(active, start=skip if epoch == first_epoch else 0):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if mode == "stop" and (epoch, i) == (1, 4):
                accelerator.save_state(folder)
                return {}
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def test_a_two_rank_run_stopped_mid_epoch_and_resumed_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "checkpoint")
    full = launch(resumable_run, folder, "full")
    launch(resumable_run, folder, "stop")
    assert sorted(p.name for p in Path(folder).iterdir()) == [
        "gradients_0.bin",
        "gradients_1.bin",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "sampler.bin",
        "scheduler.bin",
    ]
    resumed = launch(resumable_run, folder, "resume")
    for rank in (0, 1):
        for name, value in full[0].items():
            torch.testing.assert_close(resumed[rank][name], value, rtol=1e-6, atol=1e-7)


def fsdp_run(folder: str, mode: str) -> dict[str, torch.Tensor]:
    """FSDP2 on 2 ranks: "full" trains 8 steps; "stop" saves after 4; "resume" loads and trains 4."""
    from notebook_launcher.accelerator import Accelerator, FullyShardedDataParallelPlugin, set_seed

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    set_seed(0 if mode != "resume" else 99)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps = range(8)
    if mode == "resume":
        accelerator.load_state(folder)
        steps = range(4, 8)
    for step in steps:
        x = torch.linspace(-1, 1, 12).reshape(3, 4) * (step + 1 + accelerator.process_index)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if mode == "stop" and step == 3:
            accelerator.save_state(folder)
            return {}
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def test_an_fsdp2_run_saved_and_resumed_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    folder = str(tmp_path / "checkpoint")
    full = launch(fsdp_run, folder, "full")[0]
    launch(fsdp_run, folder, "stop")
    assert (Path(folder) / "pytorch_model.bin").exists()  # the gathered full weights
    resumed = launch(fsdp_run, folder, "resume")[0]
    assert full.keys() == resumed.keys() and full
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-7)


# ---- collectives -------------------------------------------------------------------------------
def mixed_metrics() -> list[Any]:
    from torch.utils.data import DataLoader

    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator()
    samples = [{"x": torch.tensor([float(i)]), "name": f"s{i}"} for i in range(5)]
    loader = accelerator.prepare(DataLoader(samples, batch_size=2))
    seen: list[Any] = []
    for batch in loader:
        gathered = accelerator.gather_for_metrics({"x": batch["x"], "name": batch["name"]})
        seen.extend(zip(gathered["x"].flatten().tolist(), gathered["name"]))
    return seen


def test_gather_for_metrics_of_mixed_tensor_and_string_batches_counts_each_sample_once() -> None:
    seen = launch(mixed_metrics)
    expected = [(float(i), f"s{i}") for i in range(5)]
    assert seen[0] == expected and seen[1] == expected  # 5 samples, not 6


def gather_mismatched() -> None:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator()
    accelerator.gather(torch.zeros(accelerator.process_index + 1, 2))


def test_gathering_tensors_of_different_shapes_is_a_clear_error_naming_pad_across_processes() -> (
    None
):
    with pytest.raises(
        CollectiveError,
        match=r"gather needs tensors of the same shape and dtype on every rank, but the ranks passed different ones \(rank 0: \[1, 2\]; rank 1: \[2, 2\]\)\. Make them equal first, e\.g\. accelerator\.pad_across_processes",
    ):
        launch(gather_mismatched)


def reductions() -> dict[str, list[float]]:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator()
    value = torch.tensor([1.0, 5.0]) if accelerator.process_index == 0 else torch.tensor([3.0, 2.0])
    return {op: accelerator.reduce(value, op).tolist() for op in ("max", "min", "sum", "mean")}


def test_reduce_max_and_min_combine_the_ranks_elementwise() -> None:
    for result in launch(reductions):
        assert result == {
            "max": [3.0, 5.0],
            "min": [1.0, 2.0],
            "sum": [4.0, 7.0],
            "mean": [2.0, 3.5],
        }


# ---- dispatched batches ------------------------------------------------------------------------
def dispatched(split_batches: bool) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from notebook_launcher.accelerator import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(
            dispatch_batches=True, split_batches=split_batches
        )
    )
    loader = accelerator.prepare(DataLoader(list(range(11)), batch_size=4 if split_batches else 2))
    mine, metrics = [], []
    for batch in loader:
        mine.append(batch.tolist())
        metrics.extend(accelerator.gather_for_metrics(batch).tolist())
    return {"mine": mine, "metrics": metrics, "len": len(loader)}


@pytest.mark.parametrize("split_batches", [False, True])
def test_dispatched_batches_give_each_rank_its_part_in_the_global_order(
    split_batches: bool,
) -> None:
    rank0, rank1 = launch(dispatched, split_batches)
    assert rank0["mine"] == [[0, 1], [4, 5], [8, 9]]
    assert rank1["mine"] == [
        [2, 3],
        [6, 7],
        [10, 0],
    ]  # the short last step is filled from the start
    assert rank0["metrics"] == rank1["metrics"] == list(range(11))
    assert rank0["len"] == rank1["len"] == 3


# ---- fp16 on CPU ranks -------------------------------------------------------------------------
def fp16_in_rank() -> list[str]:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    seen: list[str] = []
    accelerator.unwrap_model(model)[0].register_forward_hook(
        lambda m, i, o: seen.append(str(o.dtype))
    )
    accelerator.backward(model(torch.randn(2, 4)).sum())
    return [*seen, type(accelerator.scaler).__name__]


def test_fp16_in_cpu_ranks_runs_float16_inside_the_model_with_gradient_scaling() -> None:
    for result in launch(fp16_in_rank):
        assert result == ["torch.float16", "GradScaler"]
