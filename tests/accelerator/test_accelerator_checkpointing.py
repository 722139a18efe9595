"""save_state / load_state, ProjectConfiguration and skip_first_batches in one process.

The 2-rank resume (stopped mid-epoch, resumed, same weights as an uninterrupted run) is
in test_accelerator_ranks_compat.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher.accelerator import (
    Accelerator,
    CheckpointError,
    ProjectConfiguration,
    set_seed,
)
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def build(accelerator: Accelerator, seed: int = 0) -> tuple[torch.nn.Module, Any, DataLoader, Any]:
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(22, 3, generator=generator), torch.randn(22, 1, generator=generator)
    )
    loader = DataLoader(data, batch_size=4, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)  # type: ignore[no-any-return]


def train(
    accelerator: Accelerator,
    parts: tuple[Any, ...],
    epochs: range,
    *,
    stop_at: tuple[int, int] | None = None,
    skip: int = 0,
    folder: Path | None = None,
) -> dict[str, torch.Tensor]:
    model, optimizer, loader, scheduler = parts
    for epoch in epochs:
        active = (
            accelerator.skip_first_batches(loader, skip) if skip and epoch == epochs[0] else loader
        )
        for i, (x, y) in enumerate(active, start=skip if epoch == epochs[0] else 0):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if stop_at == (epoch, i):
                accelerator.save_state(folder)
                return {}
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def test_a_run_stopped_mid_epoch_and_resumed_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    full = Accelerator(gradient_accumulation_steps=2)
    expected = train(full, build(full), range(3))

    first = Accelerator(gradient_accumulation_steps=2)
    # Batch 2 of the epoch is mid-cycle: its gradients are held, not yet applied.
    train(first, build(first), range(3), stop_at=(1, 2), folder=tmp_path / "ckpt")

    resumed = Accelerator(gradient_accumulation_steps=2)
    parts = build(resumed, seed=123)  # different initial weights and RNG: the checkpoint wins
    resumed.load_state(tmp_path / "ckpt")
    got = train(resumed, parts, range(1, 3), skip=3)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)


def test_state_restores_model_optimizer_scheduler_rng_and_registered_objects(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader, scheduler = build(accelerator)
    counter = Counter()
    counter.count = 5
    accelerator.register_for_checkpointing(counter)
    train(accelerator, (model, optimizer, loader, scheduler), range(1))
    accelerator.save_state(tmp_path / "s", safe_serialization=False)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_lr, saved_scale = scheduler.get_last_lr(), accelerator.scaler.get_scale()  # type: ignore[union-attr]
    expected_draw = torch.rand(3)

    other = Accelerator(mixed_precision="fp16")
    parts = build(other, seed=99)
    restored_counter = Counter()
    other.register_for_checkpointing(restored_counter)
    other.load_state(tmp_path / "s")
    for name, value in saved.items():
        torch.testing.assert_close(parts[0].state_dict()[name], value)
    assert parts[3].get_last_lr() == saved_lr
    assert other.scaler.get_scale() == saved_scale  # type: ignore[union-attr]
    assert parts[1].state_dict()["state"]  # momentum buffers came back
    assert restored_counter.count == 5
    torch.testing.assert_close(torch.rand(3), expected_draw)  # the RNG continues as saved
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "custom_checkpoint_0.pkl",
        "optimizer.bin",
        "pytorch_model.bin",
        "random_states_0.pkl",
        "sampler.bin",
        "scaler.pt",
        "scheduler.bin",
    ]


def test_automatic_naming_counts_up_keeps_the_limit_and_loads_the_latest(tmp_path: Path) -> None:
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_dir=tmp_path, project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    for value in (1.0, 2.0, 3.0):
        with torch.no_grad():
            model.weight.fill_(value)
        accelerator.save_state()
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["checkpoint_1", "checkpoint_2"]
    assert (tmp_path / "checkpoints" / "checkpoint_2" / "model.safetensors").exists()

    again = Accelerator(
        project_dir=tmp_path, project_config=ProjectConfiguration(automatic_checkpoint_naming=True)
    )
    restored = again.prepare(torch.nn.Linear(2, 1))
    again.load_state()
    assert restored.weight.unique().tolist() == [3.0]
    assert again.project_configuration.iteration == 3  # the next save does not overwrite


def test_skip_first_batches_leaves_out_the_batches_already_seen() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    skipped = accelerator.skip_first_batches(loader, 2)
    assert [b.tolist() for (b,) in skipped] == [[6, 7, 8], [9]]
    assert len(skipped) == 2
    plain = accelerator.skip_first_batches(DataLoader(list(range(5)), batch_size=2), 1)
    assert [b.tolist() for b in plain] == [[2, 3], [4]]


def test_saving_without_a_folder_is_an_error_naming_both_ways() -> None:
    with pytest.raises(
        CheckpointError,
        match=r"save_state\(\) needs a folder: pass save_state\(output_dir=...\), or create the Accelerator with ProjectConfiguration\(automatic_checkpoint_naming=True\)",
    ):
        Accelerator().save_state()


def test_loading_a_missing_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"load_state\('.*nowhere'\): no such folder"):
        Accelerator().load_state(tmp_path / "nowhere")


def test_registering_an_object_without_state_dict_is_an_error() -> None:
    with pytest.raises(
        CheckpointError, match=r"without state_dict\(\) and load_state_dict\(\) methods \(int\)"
    ):
        Accelerator().register_for_checkpointing(3)


def test_loading_with_other_registered_objects_is_an_error(tmp_path: Path) -> None:
    accelerator = Accelerator()
    accelerator.save_state(tmp_path / "s")
    other = Accelerator()
    other.register_for_checkpointing(Counter())
    with pytest.raises(
        CheckpointError, match=r"holds 0 registered object\(s\) but 1 are registered now"
    ):
        other.load_state(tmp_path / "s")
