"""The training loop in one process: accumulation, stepping, clipping, saving, helpers."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher.accelerator import (
    Accelerator,
    AcceleratorError,
    AutocastKwargs,
    add_metric_sink,
    remove_metric_sink,
    set_seed,
    tqdm,
)
from notebook_launcher.accelerator.accelerator_state import split_between
from tests.support.accelerator import SCRIPTS, plain_process  # noqa: F401

sys.path.insert(0, str(SCRIPTS))
import common

pytestmark = pytest.mark.usefixtures("plain_process")


def test_one_process_matches_the_plain_pytorch_loop_exactly() -> None:
    reference = common.train_reference(batch_size=8)
    got = common.train_with_accelerator(Accelerator(), batch_size=8)
    for name, value in reference["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value)
    assert got["norms"] == reference["norms"]


def test_accumulating_two_batches_of_b_matches_one_batch_of_2b() -> None:
    reference = common.train_reference(batch_size=8)
    got = common.train_with_accelerator(Accelerator(gradient_accumulation_steps=2), batch_size=4)
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], value, atol=1e-6, rtol=1e-5)
    assert got["lr"] == pytest.approx(reference["lr"])


class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure: Any = None) -> Any:
        type(self).steps += 1
        return super().step(closure)


def test_gradients_sync_every_nth_batch_and_on_the_last_one() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model = torch.nn.Linear(2, 1)
    CountingSGD.steps = 0
    optimizer = CountingSGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(7, 2)), batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    syncs = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert syncs == [False, False, True, False, False, True, True]
    assert CountingSGD.steps == 3
    assert scheduler.get_last_lr() == pytest.approx([0.1 * 0.5**3])  # once per optimizer step


def test_gradients_accumulate_until_the_optimizer_steps() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    grads = []
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 1)).sum())
            grads.append(float(model.weight.grad))
            optimizer.step()
            optimizer.zero_grad()
    assert grads == [0.5, 1.0]  # each backward adds loss / 2; zero_grad waits for the step
    assert model.weight.grad is None


def test_clip_grad_norm_returns_the_norm_and_clips() -> None:
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(3, 1))
    accelerator.backward(model(torch.ones(1, 3) * 10).sum())
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert float(norm) == pytest.approx(float(expected))
    assert float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) == pytest.approx(
        1.0, rel=1e-4
    )
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(float(p.grad.abs().max()) for p in model.parameters()) <= 0.01


def test_prepare_returns_objects_in_the_given_order_and_passes_others_through() -> None:
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    marker = object()
    loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    prepared = accelerator.prepare(optimizer, marker, loader, model)
    assert isinstance(prepared[0], torch.optim.Optimizer) and prepared[1] is marker
    assert isinstance(prepared[2], DataLoader) and prepared[3] is model
    assert accelerator.prepare(prepared[0]) is prepared[0]  # preparing twice changes nothing
    assert prepared[0].param_groups is optimizer.param_groups
    assert prepared[0].state_dict()["param_groups"][0]["lr"] == 0.1


def test_state_dict_and_save_write_a_checkpoint_that_reloads(tmp_path: Path) -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(common.make_model())
    accelerator.save(accelerator.get_state_dict(model), tmp_path / "model.pt")
    fresh = common.make_model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(
            fresh(common.probe()),
            accelerator.unwrap_model(model, keep_fp32_wrapper=False)(common.probe()),
        )


def test_collectives_in_one_process_return_this_process_values() -> None:
    accelerator = Accelerator()
    assert accelerator.gather(torch.tensor([1, 2])).tolist() == [1, 2]
    assert accelerator.gather(torch.tensor(3.0)).tolist() == [3.0]
    assert accelerator.reduce(torch.tensor([2.0]), reduction="mean").tolist() == [2.0]
    assert accelerator.pad_across_processes(torch.ones(2, 3), dim=1).shape == (2, 3)
    with accelerator.split_between_processes(["a", "b"]) as mine:
        assert mine == ["a", "b"]
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():
        pass
    accelerator.end_training()


def test_reduce_with_an_unknown_reduction_is_an_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"reduce\(..., reduction='median'\) is not a reduction this core knows; use 'sum', 'mean', 'max' or 'min'",
    ):
        Accelerator().reduce(torch.tensor([1.0]), reduction="median")


def test_reduce_max_and_min_in_one_process_return_the_values() -> None:
    accelerator = Accelerator()
    assert accelerator.reduce(torch.tensor([1.0, 3.0]), reduction="max").tolist() == [1.0, 3.0]
    assert accelerator.reduce(torch.tensor([2.0]), reduction="min", scale=2.0).tolist() == [4.0]


def test_gather_for_metrics_in_one_process_returns_every_prediction() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=3))
    gathered = [int(v) for (x,) in loader for v in accelerator.gather_for_metrics(x)]
    assert gathered == list(range(7))


def test_split_between_processes_of_a_dict_needs_equal_lengths() -> None:
    with pytest.raises(
        AcceleratorError, match=r"a dict whose values have different lengths \{'a': 2, 'b': 1\}"
    ):
        split_between({"a": [1, 2], "b": [3]}, rank=0, world_size=2, apply_padding=False)


def test_split_between_processes_refuses_what_it_cannot_split() -> None:
    with pytest.raises(
        AcceleratorError, match=r"cannot split a set; pass a list, tuple, tensor, or a dict of them"
    ):
        split_between({1, 2}, rank=0, world_size=2, apply_padding=False)


def test_split_between_processes_pads_tensors_with_the_last_row() -> None:
    share = split_between(torch.arange(5), rank=1, world_size=2, apply_padding=True)
    assert share.tolist() == [3, 4, 4]


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_gradient_accumulation_steps_must_be_a_positive_integer(steps: Any) -> None:
    with pytest.raises(
        AcceleratorError,
        match=rf"gradient_accumulation_steps={steps!r}; it must be an integer >= 1",
    ):
        Accelerator(gradient_accumulation_steps=steps)


def test_kwargs_handlers_must_be_known_and_unique() -> None:
    with pytest.raises(
        AcceleratorError,
        match=r"kwargs_handlers got a dict; it takes instances of AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs",
    ):
        Accelerator(kwargs_handlers=[{"enabled": False}])  # type: ignore[list-item]
    with pytest.raises(
        AcceleratorError,
        match=r"kwargs_handlers holds two AutocastKwargs objects; pass one of each kind",
    ):
        Accelerator(kwargs_handlers=[AutocastKwargs(), AutocastKwargs(enabled=False)])


def test_log_keeps_metrics_and_feeds_registered_sinks() -> None:
    received: list[tuple[int, Any, dict[str, Any]]] = []

    def sink(rank: int, step: Any, values: dict[str, Any]) -> None:
        received.append((rank, step, values))

    accelerator = Accelerator()
    add_metric_sink(sink)
    try:
        accelerator.log({"loss": 0.5}, step=3)
    finally:
        remove_metric_sink(sink)
    accelerator.log({"loss": 0.25})
    assert received == [(0, 3, {"loss": 0.5})]
    assert accelerator.logged == [{"step": 3, "loss": 0.5}, {"step": None, "loss": 0.25}]


def test_tqdm_shows_on_the_main_process_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tqdm(range(3), file=io.StringIO()).disable
    assert not tqdm(range(3), main_process_only=False, file=io.StringIO()).disable
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert not Accelerator().tqdm(range(3), file=io.StringIO()).disable


def test_set_seed_makes_runs_repeat_and_device_specific_seeds_add_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_seed(11)
    first = torch.rand(3)
    set_seed(11)
    assert torch.equal(torch.rand(3), first)
    monkeypatch.setenv("RANK", "1")
    set_seed(11, device_specific=True)
    shifted = torch.rand(3)
    set_seed(12)
    assert torch.equal(torch.rand(3), shifted)
    assert not torch.equal(shifted, first)


def test_on_main_process_runs_the_function_in_one_process() -> None:
    accelerator = Accelerator()
    assert accelerator.on_main_process(lambda: 42)() == 42
    assert accelerator.on_local_main_process(lambda: 7)() == 7
