"""Mixed precision: which precision runs, whether it can, and the torch parts that do it.

"bf16" is ``torch.autocast`` to bfloat16 (CPU, CUDA, XLA); "fp16" is autocast to float16
plus a ``torch.amp.GradScaler`` (CUDA, CPU, MPS); "fp8" converts eligible Linear layers with
torchao's float8 training and runs the remaining ops under bf16 autocast (Hopper/Ada
GPUs). What was asked is what runs: an impossible choice raises, it never degrades to
fp32 silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from notebook_launcher import hardware
from notebook_launcher.accelerator.kwargs import AutocastKwargs, GradScalerKwargs
from notebook_launcher.errors import MissingDependencyError, MixedPrecisionError
from notebook_launcher.rank_env import MIXED_PRECISION

PRECISIONS = hardware.PRECISIONS
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
_AUTOCAST_DEVICE_TYPES = {"cuda": "cuda", "cpu": "cpu", "tpu": "xla", "mps": "mps"}
# torch scales fp16 gradients on these devices (torch.amp.GradScaler(device)).
_GRAD_SCALER_DEVICES = ("cuda", "cpu", "mps")
# torchao's float8 matmuls need both Linear dimensions to be multiples of 16.
FP8_DIM_MULTIPLE = 16


def resolve_mixed_precision(
    requested: str | None, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The precision to run and who asked for it: the explicit argument wins over the launcher."""
    env = os.environ if environ is None else environ
    if requested is not None:
        raw, source = str(requested), f"Accelerator(mixed_precision={requested!r})"
    elif env.get(MIXED_PRECISION, "").strip():
        raw = env[MIXED_PRECISION]
        source = f"{MIXED_PRECISION}={raw!r} (set by the launcher)"
    else:
        return "no", "the default"
    value = raw.strip().lower()
    if value not in PRECISIONS:
        raise MixedPrecisionError(
            f"{source} is not a precision this core knows; choose one of "
            f"{', '.join(repr(p) for p in PRECISIONS)}."
        )
    return value, source


def _report_without_gpus() -> hardware.HardwareReport:
    # precision_support only reads the report for CUDA; other device kinds need no detection.
    return hardware.HardwareReport(
        cpu_count=1,
        gpus=(),
        driver_version=None,
        tpu_cores=0,
        mps_available=False,
        platform="local",
        python_version="",
        torch_version=None,
        torch_xla_version=None,
    )


def check_precision_supported(
    precision: str,
    *,
    device_kind: str,
    local_rank: int,
    source: str,
    detect_hardware: Callable[[], hardware.HardwareReport] = hardware.detect,
) -> None:
    """Raise MixedPrecisionError naming the device when ``precision`` cannot run on it."""
    if precision == "no":
        return
    if device_kind == "cuda" and precision in ("bf16", "fp8"):
        report = detect_hardware()
        if 0 <= local_rank < len(report.gpus):
            # Judge this rank's GPU only; a mixed machine may have one that can.
            report = dataclasses.replace(report, gpus=(report.gpus[local_rank],))
    else:
        report = _report_without_gpus()
    reason = hardware.precision_support(report, device_kind)[precision]
    if reason is not None:
        raise MixedPrecisionError(
            f"{source} asks for {precision!r}, which cannot run here: {reason}. Choose "
            "another precision with Accelerator(mixed_precision=...) or "
            "notebook_launcher(..., mixed_precision=...)."
        )


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """How one precision is carried out on one device kind."""

    mixed_precision: str
    device_kind: str
    autocast_kwargs: AutocastKwargs = dataclasses.field(default_factory=AutocastKwargs)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPES.get(self.mixed_precision)

    @property
    def uses_autocast(self) -> bool:
        return self.autocast_dtype is not None and self.autocast_kwargs.enabled

    @property
    def uses_grad_scaler(self) -> bool:
        return self.mixed_precision == "fp16" and self.device_kind in _GRAD_SCALER_DEVICES

    @property
    def uses_fp8(self) -> bool:
        return self.mixed_precision == "fp8"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.autocast_dtype
        if dtype is None or not self.autocast_kwargs.enabled:
            return contextlib.nullcontext()
        extra: dict[str, Any] = {}
        if self.autocast_kwargs.cache_enabled is not None:
            extra["cache_enabled"] = self.autocast_kwargs.cache_enabled
        return torch.autocast(_AUTOCAST_DEVICE_TYPES[self.device_kind], dtype=dtype, **extra)

    def make_grad_scaler(self, kwargs: GradScalerKwargs | None) -> torch.amp.GradScaler | None:
        if not self.uses_grad_scaler:
            return None
        return torch.amp.GradScaler(self.device_kind, **(kwargs.to_kwargs() if kwargs else {}))


def outputs_to_fp32(value: Any) -> Any:
    """Half-precision floating tensors in a (nested) model output, cast back to float32.

    The loss the user computes from the output then runs in full precision, as it
    would without autocast.
    """
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, dict):
        return type(value)((k, outputs_to_fp32(v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(outputs_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(outputs_to_fp32(v) for v in value)
    return value


class AutocastForward:
    """A prepared model's ``forward``: the model's own forward under the plan's autocast.

    A plain object holding the module, not a closure: ``copy.deepcopy`` of the model then
    gives a copy whose forward runs the COPY's weights (the memo maps ``module`` to the
    copy), and ``torch.save``/pickle of the model works (the class and the forward's
    function are found by name).
    """

    def __init__(
        self, module: torch.nn.Module, function: Callable[..., Any], plan: PrecisionPlan
    ) -> None:
        self.module = module
        self.function = function  # the unbound forward of the module's class
        self.plan = plan
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.plan.autocast():
            output = self.function(self.module, *args, **kwargs)
        return outputs_to_fp32(output)

    def __getstate__(self) -> dict[str, Any]:
        # update_wrapper copied the function's __dict__ and __wrapped__; the rest rebuilds them.
        return {"module": self.module, "function": self.function, "plan": self.plan}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"], state["function"], state["plan"])  # type: ignore[misc]


def patch_forward_with_autocast(model: torch.nn.Module, plan: PrecisionPlan) -> None:
    """Run ``model``'s forward under the plan's autocast, so a prepared model needs no ``with``."""
    if not plan.uses_autocast or isinstance(model.__dict__.get("forward"), AutocastForward):
        return
    original = model.forward
    if getattr(original, "__self__", None) is model:
        function = original.__func__  # type: ignore[attr-defined]
    else:
        # An instance-level forward someone set before: call it without passing the module.
        function = _CallIgnoringModule(original)
    model.forward = AutocastForward(model, function, plan)


class _CallIgnoringModule:
    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


def restore_forward(model: torch.nn.Module) -> None:
    patched = model.__dict__.get("forward")
    if isinstance(patched, AutocastForward):
        del model.__dict__["forward"]
        if isinstance(patched.function, _CallIgnoringModule):
            model.forward = patched.function.forward


def convert_to_fp8(model: torch.nn.Module) -> list[str]:
    """Swap eligible Linear layers for torchao float8 training ones; returns their names."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise MissingDependencyError(
            "mixed_precision='fp8' trains through torchao's float8 Linear layers, and torchao "
            f"is not importable ({e}); install a release matching torch {torch.__version__} "
            "with `pip install torchao`, or choose mixed_precision='bf16'."
        ) from e
    converted: list[str] = []

    def eligible(module: torch.nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, torch.nn.Linear)
            and module.in_features % FP8_DIM_MULTIPLE == 0
            and module.out_features % FP8_DIM_MULTIPLE == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=eligible)
    if not converted:
        warnings.warn(
            "mixed_precision='fp8' found no Linear layer whose in_features and out_features "
            f"are both multiples of {FP8_DIM_MULTIPLE}, so no layer runs in float8 and the "
            "model trains in bf16 autocast; make the Linear sizes multiples of 16 to use fp8.",
            stacklevel=3,
        )
    return converted
