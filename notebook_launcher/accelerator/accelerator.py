"""The Accelerator: a few added lines make a raw PyTorch loop distributed and mixed-precision.

Names and behaviour follow Hugging Face accelerate's public API, so its documentation
and examples transfer. Built on torch's own parts: DDP or FSDP2 ``fully_shard``,
``torch.autocast`` and ``GradScaler``, sharded samplers, torchao float8.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from notebook_launcher import tracking
from notebook_launcher.accelerator import operations, precision, processes
from notebook_launcher.accelerator.data import (
    DataLoaderConfiguration,
    DataLoaderShard,
    prepare_data_loader,
)
from notebook_launcher.accelerator.fsdp import full_state_dict, is_fully_sharded, shard_model
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.kwargs import (
    KWARGS_HANDLER_TYPES,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    KwargsHandler,
)
from notebook_launcher.accelerator.optimizer import AcceleratedOptimizer
from notebook_launcher.accelerator.scheduler import AcceleratedScheduler
from notebook_launcher.accelerator.state import (
    DistributedType,
    init_process_group_if_needed,
    read_rank_state,
)
from notebook_launcher.accelerator.utils import tqdm as _tqdm
from notebook_launcher.errors import AcceleratorError

F = TypeVar("F", bound=Callable[..., Any])
_LRScheduler = torch.optim.lr_scheduler.LRScheduler


def _index_handlers(handlers: Iterable[KwargsHandler] | None) -> dict[type, KwargsHandler]:
    found: dict[type, KwargsHandler] = {}
    for handler in handlers or ():
        if not isinstance(handler, KWARGS_HANDLER_TYPES):
            names = ", ".join(t.__name__ for t in KWARGS_HANDLER_TYPES)
            raise AcceleratorError(
                f"kwargs_handlers got a {type(handler).__name__}; it takes instances of {names}."
            )
        if type(handler) in found:
            raise AcceleratorError(
                f"kwargs_handlers holds two {type(handler).__name__} objects; pass one of each kind."
            )
        found[type(handler)] = handler
    return found


class Accelerator:
    """Makes a training loop run on every rank of a launch, in the precision asked for.

    With no arguments it takes what the launcher chose (precision, device) from the rank's
    environment; explicit arguments win. In one plain process it runs with world size 1.
    """

    def __init__(
        self,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        kwargs_handlers: Iterable[KwargsHandler] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        device_placement: bool = True,
        step_scheduler_with_optimizer: bool = True,
    ) -> None:
        if (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise AcceleratorError(
                f"gradient_accumulation_steps={gradient_accumulation_steps!r}; it must be an "
                "integer >= 1 (1 means step the optimizer every batch)."
            )
        handlers = _index_handlers(kwargs_handlers)
        self.state = read_rank_state(cpu=cpu)
        chosen, source = precision.resolve_mixed_precision(mixed_precision)
        precision.check_precision_supported(
            chosen,
            device_kind=self.state.device_kind,
            local_rank=self.state.local_rank,
            source=source,
        )
        self._created_process_group = init_process_group_if_needed(self.state)
        autocast_kwargs = handlers.get(AutocastKwargs)
        self._precision = precision.PrecisionPlan(
            chosen,
            self.state.device_kind,
            autocast_kwargs or AutocastKwargs(),  # type: ignore[arg-type]
        )
        self.scaler = self._precision.make_grad_scaler(handlers.get(GradScalerKwargs))  # type: ignore[arg-type]
        ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self._ddp_kwargs = ddp_handler.to_kwargs() if ddp_handler else {}
        self.fsdp_plugin = fsdp_plugin
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_state = GradientState(num_steps=gradient_accumulation_steps)
        self.fp8_layers: list[str] = []
        self.logged: list[dict[str, Any]] = []
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoaderShard] = []
        self._parameter_swaps: dict[int, torch.nn.Parameter] = {}

    # ---- who and where -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def mixed_precision(self) -> str:
        return self._precision.mixed_precision

    @property
    def distributed_type(self) -> DistributedType:
        if self.state.device_kind == "tpu":
            return DistributedType.XLA
        if self.state.world_size == 1:
            return DistributedType.NO
        if self.fsdp_plugin is not None:
            return DistributedType.FSDP
        return (
            DistributedType.MULTI_GPU
            if self.state.device_kind == "cuda"
            else DistributedType.MULTI_CPU
        )

    @property
    def use_distributed(self) -> bool:
        return self.state.world_size > 1

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @property
    def sync_gradients(self) -> bool:
        """True on the steps where gradients are synchronised and the optimizer steps."""
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        return (
            f"Accelerator(process_index={self.process_index}, num_processes={self.num_processes}, "
            f"device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"distributed_type={self.distributed_type.value})"
        )

    # ---- prepare -------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: bool | None = None) -> Any:
        """Models, optimizers, data loaders and LR schedulers, in any order, made ready.

        Returns them in the order given (one object when one is given); anything else
        passes through unchanged.
        """
        results = list(objects)
        # Models first: FSDP2 replaces parameters, and optimizers must then hold the new ones.
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.nn.Module):
                results[i] = self.prepare_model(obj, device_placement=device_placement)
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                results[i] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                results[i] = self.prepare_data_loader(obj, device_placement=device_placement)
        for i, obj in enumerate(objects):
            if isinstance(obj, _LRScheduler):
                results[i] = self.prepare_scheduler(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None
    ) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel) or is_fully_sharded(model):
            return model  # prepared already
        place = self.device_placement if device_placement is None else device_placement
        if place and self.state.device_kind == "tpu":
            from notebook_launcher.accelerator import xla

            # Moving to XLA makes new Parameters: optimizers built before must follow them.
            self._parameter_swaps.update(xla.move_model(model, self.device))
        elif place:
            model = model.to(self.device)
        if self._precision.uses_fp8:
            self.fp8_layers = precision.convert_to_fp8(model)
        precision.patch_forward_with_autocast(model, self._precision)
        self._models.append(model)
        if self.state.world_size == 1 or self.state.device_kind == "tpu":
            return model  # XLA reduces gradients in the optimizer step instead
        if self.fsdp_plugin is not None:
            self._parameter_swaps.update(shard_model(model, self.fsdp_plugin))
            return model
        device_ids = [self.state.local_rank] if self.state.device_kind == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **self._ddp_kwargs)
        self._models[-1] = ddp
        return ddp

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        if self._parameter_swaps:
            for group in optimizer.param_groups:
                group["params"] = [self._parameter_swaps.get(id(p), p) for p in group["params"]]
        wrapped = AcceleratedOptimizer(
            optimizer,
            gradient_state=self.gradient_state,
            scaler=self.scaler,
            device_kind=self.state.device_kind,
        )
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoaderShard:
        if isinstance(data_loader, DataLoaderShard):
            return data_loader
        place = self.device_placement if device_placement is None else device_placement
        prepared = prepare_data_loader(
            data_loader,
            state=self.state,
            config=self.dataloader_config,
            gradient_state=self.gradient_state,
            device_placement=place,
        )
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        wrapped = AcceleratedScheduler(
            scheduler,
            self._optimizers,
            gradient_state=self.gradient_state,
            step_with_optimizer=self.step_scheduler_with_optimizer,
        )
        self._schedulers.append(wrapped)
        return wrapped

    # ---- the training step ---------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled for fp16 and divided over accumulation steps."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def autocast(
        self, autocast_handler: AutocastKwargs | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Autocast to this Accelerator's precision for code outside a prepared model's forward."""
        if autocast_handler is None:
            return self._precision.autocast()
        plan = precision.PrecisionPlan(
            self.mixed_precision, self.state.device_kind, autocast_handler
        )
        return plan.autocast()

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every N-th or the last batch."""
        state = self.gradient_state
        state.step += 1
        if state.end_of_dataloader:
            state.sync_gradients, state.step = True, 0  # the next epoch starts a fresh cycle
        else:
            state.sync_gradients = state.step % state.num_steps == 0
        with contextlib.ExitStack() as stack:
            if not state.sync_gradients:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Gradients stay local to this rank inside the block (no all-reduce)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif is_fully_sharded(model):
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
        else:
            yield

    def unscale_gradients(self) -> None:
        """Divide fp16 gradients by the loss scale (once per step), e.g. before clipping."""
        if self.scaler is None:
            return
        for opt in self._optimizers:
            if not opt.gradients_unscaled:
                self.scaler.unscale_(opt.optimizer)
                opt.gradients_unscaled = True

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip the gradients' total norm across all ranks' shards; returns the norm before clipping."""
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return full() if callable(full) else norm

    def clip_grad_value_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float
    ) -> None:
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ---- collectives -----------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions of a prepared loader's batch; on its last batch, drop the repeats.

        even_batches fills the last step with samples from the start of the data set;
        they are cut off here, so every sample is counted exactly once, in order.
        """
        tensors_only = _all_tensors(input_data)
        if use_gather_object or not tensors_only:
            data: Any = operations.gather_object(input_data)
        else:
            data = operations.gather(input_data)
        loader = self.gradient_state.active_loader
        if loader is None or not loader.end_of_dataloader:
            return data
        real = loader.last_round_real_samples
        if real is None:
            return data
        if isinstance(data, list) and not tensors_only:
            return data[:real]
        return operations.recursively_apply(lambda t: t[:real], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return operations.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        return operations.pad_across_processes(
            tensor, dim=dim, pad_index=pad_index, pad_first=pad_first
        )

    # ---- coordinating processes ----------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        processes.barrier(self.state.device_kind, self.state.local_rank)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return processes.first_then_others(
            self.is_main_process, self.state.device_kind, self.state.local_rank
        )

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return processes.first_then_others(
            self.is_local_main_process, self.state.device_kind, self.state.local_rank
        )

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous share of a list, tuple, tensor or dict of them."""
        yield processes.split_between(inputs, self.process_index, self.num_processes, apply_padding)

    def on_main_process(self, function: F) -> F:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper  # type: ignore[return-value]

    def on_local_main_process(self, function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper  # type: ignore[return-value]

    def tqdm(self, *args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
        return _tqdm(*args, main_process_only=main_process_only, **kwargs)

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record metrics of this rank; registered sinks (the launcher's live plot) receive them."""
        self.logged.append({"step": step, **values})
        tracking.emit(self.process_index, step, values)

    # ---- models and checkpoints --------------------------------------------------------
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True
    ) -> torch.nn.Module:
        """The user's model inside DDP / torch.compile wrappers."""
        while isinstance(model, DistributedDataParallel):
            model = model.module
        model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        if not keep_fp32_wrapper:
            precision.restore_forward(model)
        return model

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full model weights (gathered from all ranks under FSDP2: call it on every rank)."""
        if is_fully_sharded(model):
            return full_state_dict(model)
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """``torch.save`` once per machine (by the local main process)."""
        if self.state.device_kind == "tpu" and not safe_serialization:
            from notebook_launcher.accelerator import xla

            xla.save(obj, f)  # every replica takes part; one writes CPU tensors
            return
        if not self.is_local_main_process:
            return
        if safe_serialization:
            try:
                from safetensors.torch import save_file
            except ImportError as e:
                raise AcceleratorError(
                    "save(..., safe_serialization=True) needs the safetensors package: "
                    "pip install safetensors, or pass safe_serialization=False."
                ) from e
            save_file(obj, os.fspath(f))
        else:
            torch.save(obj, f)

    def end_training(self) -> None:
        """Leave the process group this Accelerator created (a group made by others stays)."""
        if self._created_process_group and dist.is_initialized():
            self.wait_for_everyone()
            dist.destroy_process_group()
            self._created_process_group = False


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return bool(data) and all(_all_tensors(d) for d in data)
    if isinstance(data, dict):
        return bool(data) and all(_all_tensors(v) for v in data.values())
    return False
