"""Which precision runs, the errors when it cannot, and proof that autocast is really on."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from notebook_launcher import hardware
from notebook_launcher.accelerator import (
    Accelerator,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    MissingDependencyError,
    MixedPrecisionError,
)
from notebook_launcher.accelerator.precision import (
    PrecisionPlan,
    check_precision_supported,
    convert_to_fp8,
    resolve_mixed_precision,
)
from tests.accelerator.test_accelerator_state import fake_report
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")

A100 = hardware.GpuInfo(0, "NVIDIA A100-SXM4-80GB", 81920, "8.0")
H100 = hardware.GpuInfo(1, "NVIDIA H100 80GB HBM3", 81559, "9.0")
T4 = hardware.GpuInfo(0, "Tesla T4", 15360, "7.5")


def test_the_explicit_precision_wins_over_the_launchers() -> None:
    assert resolve_mixed_precision("fp16", {"ACCELERATE_MIXED_PRECISION": "bf16"})[0] == "fp16"
    assert resolve_mixed_precision(None, {"ACCELERATE_MIXED_PRECISION": "BF16"})[0] == "bf16"
    assert resolve_mixed_precision(None, {}) == ("no", "the default")


def test_an_unknown_precision_argument_is_an_error_listing_the_choices() -> None:
    with pytest.raises(
        MixedPrecisionError,
        match=r"Accelerator\(mixed_precision='fp32'\) is not a precision this core knows; choose one of 'no', 'fp16', 'bf16', 'fp8'",
    ):
        Accelerator(mixed_precision="fp32")


def test_an_unknown_precision_from_the_launcher_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "half")
    with pytest.raises(
        MixedPrecisionError,
        match=r"ACCELERATE_MIXED_PRECISION='half' \(set by the launcher\) is not a precision",
    ):
        Accelerator()


def test_fp16_on_cpu_runs_the_model_in_float16_with_a_cpu_grad_scaler() -> None:
    accelerator = Accelerator(mixed_precision="fp16")
    assert isinstance(accelerator.scaler, torch.amp.GradScaler)
    assert accelerator.scaler._device == "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = model[0].weight.detach().clone()
    output = model(torch.randn(3, 4))
    assert seen == [torch.float16]  # inside the model: float16 matmuls
    assert output.dtype == torch.float32  # back in float32 for the loss
    accelerator.backward(output.pow(2).mean())
    scaled = accelerator.scaler.get_scale()
    optimizer.step()
    optimizer.zero_grad()
    assert scaled == 65536.0  # the loss was scaled before backward
    assert accelerator.optimizer_step_was_skipped or not torch.equal(before, model[0].weight)


def test_fp16_from_the_launcher_on_cpu_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    accelerator = Accelerator()
    assert accelerator.mixed_precision == "fp16"
    assert accelerator.state.mixed_precision == "fp16"
    assert accelerator.scaler is not None


def test_fp8_on_cpu_is_an_error_naming_the_device() -> None:
    with pytest.raises(
        MixedPrecisionError,
        match=r"fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU",
    ):
        Accelerator(mixed_precision="fp8")


def test_fp8_on_an_ampere_gpu_is_an_error_naming_the_gpu() -> None:
    with pytest.raises(
        MixedPrecisionError,
        match=r"fp8 needs a Hopper or Ada GPU .* NVIDIA A100-SXM4-80GB has none",
    ):
        check_precision_supported(
            "fp8",
            device_kind="cuda",
            local_rank=0,
            source="x",
            detect_hardware=lambda: fake_report((A100,)),
        )


def test_fp8_on_a_hopper_gpu_is_allowed_for_the_rank_that_has_it() -> None:
    mixed = lambda: fake_report((A100, H100))  # noqa: E731
    check_precision_supported(
        "fp8", device_kind="cuda", local_rank=1, source="x", detect_hardware=mixed
    )
    with pytest.raises(MixedPrecisionError, match="A100"):
        check_precision_supported(
            "fp8", device_kind="cuda", local_rank=0, source="x", detect_hardware=mixed
        )


def test_bf16_on_a_pre_ampere_gpu_is_an_error() -> None:
    with pytest.raises(
        MixedPrecisionError, match=r"bf16 needs an Ampere or newer GPU .* Tesla T4 is older"
    ):
        check_precision_supported(
            "bf16",
            device_kind="cuda",
            local_rank=0,
            source="x",
            detect_hardware=lambda: fake_report((T4,)),
        )


def test_fp16_on_cuda_needs_no_detection_and_uses_a_grad_scaler() -> None:
    def no_detection() -> hardware.HardwareReport:
        raise AssertionError("fp16 runs on every CUDA GPU: no detection needed")

    check_precision_supported(
        "fp16", device_kind="cuda", local_rank=0, source="x", detect_hardware=no_detection
    )
    plan = PrecisionPlan("fp16", "cuda")
    assert plan.uses_grad_scaler and plan.autocast_dtype == torch.float16
    assert not PrecisionPlan("bf16", "cuda").uses_grad_scaler


def test_fp8_runs_the_other_ops_in_bf16_autocast() -> None:
    plan = PrecisionPlan("fp8", "cuda")
    assert plan.uses_fp8 and plan.autocast_dtype == torch.bfloat16 and not plan.uses_grad_scaler


def test_tpu_autocast_uses_the_xla_device_type() -> None:
    assert PrecisionPlan("bf16", "tpu").autocast_dtype == torch.bfloat16
    with pytest.raises(MixedPrecisionError, match="fp16 is not supported on TPU; use bf16"):
        check_precision_supported("fp16", device_kind="tpu", local_rank=0, source="x")


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(32, 64)
        self.odd = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.first(x))


@pytest.fixture
def fake_torchao(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A stand-in for torchao.float8 that records which layers the filter picks."""
    converted: list[str] = []

    def convert_to_float8_training(
        model: torch.nn.Module, module_filter_fn: Any
    ) -> torch.nn.Module:
        for name, module in model.named_modules():
            if module_filter_fn(module, name):
                converted.append(name)
        return model

    float8 = types.ModuleType("torchao.float8")
    float8.convert_to_float8_training = convert_to_float8_training  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    return converted


def test_fp8_converts_only_linear_layers_with_dimensions_divisible_by_16(
    fake_torchao: list[str],
) -> None:
    assert convert_to_fp8(TwoLayers()) == ["first"]
    assert fake_torchao == ["first"]


def test_fp8_with_no_eligible_layer_warns(fake_torchao: list[str]) -> None:
    with pytest.warns(
        UserWarning,
        match=r"found no Linear layer whose in_features and out_features are both multiples of 16",
    ):
        assert convert_to_fp8(torch.nn.Linear(10, 3)) == []


def test_fp8_without_torchao_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(
        MissingDependencyError,
        match=r"torchao is not importable .* `pip install torchao`, or choose mixed_precision='bf16'",
    ):
        convert_to_fp8(TwoLayers())


def test_bf16_autocast_is_active_in_a_prepared_models_forward() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(TwoLayers())
    seen: list[torch.dtype] = []
    model.first.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    output = model(torch.randn(4, 32))
    assert seen == [torch.bfloat16]
    assert output.dtype == torch.float32  # handed back in fp32 for the loss


def test_bf16_autocast_block_casts_linear_outputs() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    layer = torch.nn.Linear(8, 8)
    with accelerator.autocast():
        assert layer(torch.randn(2, 8)).dtype == torch.bfloat16
    assert layer(torch.randn(2, 8)).dtype == torch.float32
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        assert layer(torch.randn(2, 8)).dtype == torch.float32


def test_autocast_can_be_disabled_by_its_kwargs_handler() -> None:
    accelerator = Accelerator(
        mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)]
    )
    model = accelerator.prepare(TwoLayers())
    with accelerator.autocast():
        assert model.first(torch.randn(2, 32)).dtype == torch.float32


def test_unwrap_model_can_remove_the_autocast_wrapper() -> None:
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(TwoLayers())
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    seen: list[torch.dtype] = []
    plain.first.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    plain(torch.randn(2, 32))
    assert seen == [torch.float32]
    assert "forward" not in vars(plain)


def test_no_precision_leaves_the_forward_untouched() -> None:
    model = Accelerator(mixed_precision="no").prepare(TwoLayers())
    assert "forward" not in vars(model)


def test_kwargs_handlers_pass_only_the_changed_settings_to_torch() -> None:
    assert GradScalerKwargs(init_scale=1024.0).to_kwargs() == {"init_scale": 1024.0}
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {
        "find_unused_parameters": True
    }
    assert AutocastKwargs().to_kwargs() == {}
