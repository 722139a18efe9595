"""accelerate's public API in one process: state, decorators, accumulation plugin, trackers, copies."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher.accelerator import (
    Accelerator,
    AcceleratorError,
    AcceleratorState,
    DataLoaderConfiguration,
    DistributedType,
    GeneralTracker,
    GradientAccumulationPlugin,
    GradientState,
    MissingDependencyError,
    TrackerError,
)
from notebook_launcher.accelerator.data_sharding import SeedableRandomSampler, ShardedBatchSampler
from notebook_launcher.accelerator.precision import PrecisionPlan, patch_forward_with_autocast
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def zeroed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


# ---- silent wrong results that must not come back ----------------------------------------
def test_a_deep_copy_of_a_bf16_prepared_model_runs_its_own_weights() -> None:
    torch.manual_seed(0)
    model = Accelerator(mixed_precision="bf16").prepare(torch.nn.Linear(4, 2))
    ema = zeroed(copy.deepcopy(model))
    x = torch.ones(1, 4)
    assert torch.count_nonzero(ema(x)) == 0  # the copy's zero weights, not the original's
    assert torch.count_nonzero(model(x)) > 0
    assert ema(x).dtype == torch.float32  # and the copy still runs under autocast


def test_a_deep_copy_of_a_model_under_fp8s_autocast_wrapper_runs_its_own_weights() -> None:
    # fp8 shares the bf16 forward wrapper (torchao only swaps the Linear layers).
    model = torch.nn.Linear(4, 2)
    patch_forward_with_autocast(model, PrecisionPlan("fp8", "cpu"))
    copied = zeroed(copy.deepcopy(model))
    assert torch.count_nonzero(copied(torch.ones(1, 4))) == 0


def test_a_bf16_prepared_model_and_its_unwrapped_model_pickle_with_torch_save() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()))
    x = torch.randn(2, 4)
    for obj in (model, accelerator.unwrap_model(model)):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        seen: list[torch.dtype] = []
        loaded[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        torch.testing.assert_close(loaded(x), model(x))
        assert seen == [torch.bfloat16]  # the reloaded model still runs in bf16
        zeroed(loaded)
        assert torch.count_nonzero(loaded(x)) == 0  # and runs its own weights


def test_removing_the_precision_wrapper_restores_the_class_forward() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in vars(plain)
    assert plain(torch.ones(1, 4)).dtype == torch.float32


# ---- accelerate's names ----------------------------------------------------------------
def test_the_state_has_accelerates_public_attributes() -> None:
    accelerator = Accelerator()
    state = accelerator.state
    assert isinstance(state, AcceleratorState)
    assert (state.process_index, state.local_process_index, state.num_processes) == (0, 0, 1)
    assert state.distributed_type == DistributedType.NO == "NO"
    assert state.device == torch.device("cpu") and state.mixed_precision == "no"
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed
    assert "Num processes: 1" in repr(state)


def test_process_decorators_run_where_they_name() -> None:
    accelerator = Accelerator()
    ran = lambda: "ran"  # noqa: E731
    assert accelerator.on_main_process(ran)() == "ran"
    assert accelerator.on_local_main_process(ran)() == "ran"
    assert accelerator.on_last_process(ran)() == "ran"
    assert accelerator.on_process(ran, process_index=0)() == "ran"
    assert accelerator.on_process(ran, process_index=1)() is None
    assert accelerator.on_process(process_index=0)(ran)() == "ran"
    assert accelerator.on_local_process(ran, local_process_index=1)() is None


def test_a_trigger_set_is_seen_once_then_reset() -> None:
    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False


def test_gradient_state_is_exported_and_names_the_active_loader() -> None:
    accelerator = Accelerator()
    assert isinstance(accelerator.gradient_state, GradientState)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    assert accelerator.gradient_state.active_dataloader is None
    ends = []
    for _ in loader:
        assert accelerator.gradient_state.active_dataloader is loader
        ends.append(accelerator.gradient_state.end_of_dataloader)
    assert ends == [False, False, True]
    assert accelerator.gradient_state.active_dataloader is None


def test_a_prepared_loaders_batch_sampler_wraps_the_seedable_one() -> None:
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    loader = accelerator.prepare(
        DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True)
    )
    assert isinstance(loader.batch_sampler, ShardedBatchSampler)
    assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    assert loader.batch_sampler.sampler is loader.batch_sampler.batch_sampler.sampler


def test_the_accumulation_plugin_sets_the_steps_and_syncing() -> None:
    plugin = GradientAccumulationPlugin(num_steps=3, sync_each_batch=True)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    assert accelerator.gradient_accumulation_steps == 3
    assert accelerator.gradient_state.sync_each_batch
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    synced = []
    for _ in range(6):
        with accelerator.accumulate(model):
            synced.append(accelerator.sync_gradients)
    assert synced == [False, False, True, False, False, True]


def test_steps_and_a_plugin_together_are_an_error() -> None:
    with pytest.raises(
        AcceleratorError,
        match=r"Accelerator got both gradient_accumulation_steps=2 and gradient_accumulation_plugin=.*; pass only one",
    ):
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4),
        )


# ---- trackers ------------------------------------------------------------------------------
def test_tensorboard_tracker_writes_event_files_tensorboard_reads(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.1, "layers": 2})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "note": "text"}, step=step)
    assert accelerator.get_tracker("tensorboard").name == "tensorboard"
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [
        (0, 1.0),
        (1, 0.5),
        (2, 0.3333),
    ]
    assert accelerator.logged[-1]["loss"] == pytest.approx(1 / 3)  # the launch's sink still fed


def test_a_custom_tracker_receives_config_and_values() -> None:
    class Recorder(GeneralTracker):
        name = "recorder"

        def __init__(self) -> None:
            self.seen: list[object] = []

        def store_init_configuration(self, values: object) -> None:
            self.seen.append(("config", dict(values)))  # type: ignore[call-overload]

        def log(self, values: object, step: int | None = None, **kwargs: object) -> None:
            self.seen.append((step, dict(values)))  # type: ignore[call-overload]

    recorder = Recorder()
    accelerator = Accelerator(log_with=[recorder])
    accelerator.init_trackers("p", config={"a": 1})
    accelerator.log({"x": 2.0}, step=5)
    assert recorder.seen == [("config", {"a": 1}), (5, {"x": 2.0})]


def test_an_unknown_tracker_name_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(
        TrackerError,
        match=r"log_with='neptunium' is not a tracker this core knows; choose from 'tensorboard'",
    ):
        Accelerator(log_with="neptunium")


def test_a_tracker_whose_package_is_missing_is_an_error_naming_it() -> None:
    pytest.importorskip("tensorboard")
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(MissingDependencyError, match=r"log_with='wandb' needs the wandb package"):
        Accelerator(log_with="wandb")


def test_tensorboard_without_a_folder_is_an_error_naming_project_dir() -> None:
    pytest.importorskip("tensorboard")
    accelerator = Accelerator(log_with="tensorboard")
    with pytest.raises(
        TrackerError, match=r"no logging directory is set; pass Accelerator\(project_dir=...\)"
    ):
        accelerator.init_trackers("run")
