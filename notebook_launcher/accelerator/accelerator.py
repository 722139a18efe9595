"""The Accelerator: a few added lines make a raw PyTorch loop distributed and mixed-precision.

Names and behaviour follow Hugging Face accelerate's public API, so its documentation
and examples transfer. Built on torch's own parts: DDP or FSDP2 ``fully_shard``,
``torch.autocast`` and ``GradScaler``, sharded samplers, torchao float8.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from notebook_launcher import tracking
from notebook_launcher.accelerator import model_guards, operations, precision, step_timing
from notebook_launcher.accelerator.accelerator_state import AcceleratorState
from notebook_launcher.accelerator.checkpointing import Checkpointing, ProjectConfiguration
from notebook_launcher.accelerator.coordination import Coordination
from notebook_launcher.accelerator.data import (
    DataLoaderConfiguration,
    DataLoaderShard,
    prepare_data_loader,
)
from notebook_launcher.accelerator.fsdp import full_state_dict, is_fully_sharded, shard_model
from notebook_launcher.accelerator.grad_checkpointing import CheckpointingGuard
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.kwargs import (
    KWARGS_HANDLER_TYPES,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from notebook_launcher.accelerator.lifecycle import Lifecycle
from notebook_launcher.accelerator.memory import memory_summary
from notebook_launcher.accelerator.model_files import Saving
from notebook_launcher.accelerator.optimizer import AcceleratedOptimizer
from notebook_launcher.accelerator.rank_state import (
    DistributedType,
    choose_distributed_type,
    init_process_group_if_needed,
    read_rank_state,
)
from notebook_launcher.accelerator.scheduler import AcceleratedScheduler
from notebook_launcher.accelerator.trackers import GeneralTracker, resolve_log_with, start_trackers
from notebook_launcher.accelerator.utils import tqdm as _tqdm
from notebook_launcher.accelerator.wrappers import unwrap
from notebook_launcher.errors import AcceleratorError

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


def _accumulation_plugin(
    steps: int, plugin: GradientAccumulationPlugin | None
) -> GradientAccumulationPlugin:
    if plugin is not None:
        if steps != 1:
            raise AcceleratorError(
                f"Accelerator got both gradient_accumulation_steps={steps!r} and "
                f"gradient_accumulation_plugin={plugin!r}; pass only one (the plugin's num_steps "
                "sets the steps)."
            )
        steps = 1 if plugin.num_steps is None else plugin.num_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AcceleratorError(
            f"gradient_accumulation_steps={steps!r}; it must be an "
            "integer >= 1 (1 means step the optimizer every batch)."
        )
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=steps)
    return GradientAccumulationPlugin(
        num_steps=steps,
        adjust_scheduler=plugin.adjust_scheduler,
        sync_with_dataloader=plugin.sync_with_dataloader,
        sync_each_batch=plugin.sync_each_batch,
    )


class Accelerator(Coordination, Checkpointing, Lifecycle, Saving):
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
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        log_with: str | GeneralTracker | list[str | GeneralTracker] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
    ) -> None:
        plugin = _accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
        handlers = _index_handlers(kwargs_handlers)
        rank_state = read_rank_state(cpu=cpu)
        chosen, source = precision.resolve_mixed_precision(mixed_precision)
        precision.check_precision_supported(
            chosen,
            device_kind=rank_state.device_kind,
            local_rank=rank_state.local_rank,
            source=source,
        )
        self._log_with = resolve_log_with(log_with)
        self._created_process_group = init_process_group_if_needed(rank_state)
        self.state = AcceleratorState(
            rank_state,
            chosen,
            choose_distributed_type(
                rank_state.device_kind, rank_state.world_size, fsdp_plugin is not None
            ),
        )
        autocast_kwargs = handlers.get(AutocastKwargs)
        self._precision = precision.PrecisionPlan(
            chosen,
            rank_state.device_kind,
            autocast_kwargs or AutocastKwargs(),  # type: ignore[arg-type]
        )
        self.scaler = self._precision.make_grad_scaler(handlers.get(GradScalerKwargs))  # type: ignore[arg-type]
        ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self._ddp_kwargs = ddp_handler.to_kwargs() if ddp_handler else {}
        self.fsdp_plugin = fsdp_plugin
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_accumulation_plugin = plugin
        self.gradient_state = GradientState(
            num_steps=plugin.num_steps or 1,
            adjust_scheduler=plugin.adjust_scheduler,
            sync_with_dataloader=plugin.sync_with_dataloader,
            sync_each_batch=plugin.sync_each_batch,
        )
        self.project_configuration = Checkpointing.make_project_configuration(
            project_dir, project_config
        )
        self.fp8_layers: list[str] = []
        self.logged: list[dict[str, Any]] = []
        self.trackers: list[GeneralTracker] = []
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoaderShard] = []
        self._custom_objects: list[Any] = []
        self._parameter_swaps: dict[int, torch.nn.Parameter] = {}
        self._checkpointing_guard = CheckpointingGuard()
        self._profile_kwargs = handlers.get(ProfileKwargs)  # type: ignore[assignment]
        # OrderedDict: torch's RemovableHandle holds them by weak reference.
        self._save_state_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._load_state_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._step_clock = step_timing.start(rank_state.rank, rank_state.world_size)

    # ---- who and where -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

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
        return self.state.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.num_steps = steps

    @property
    def step(self) -> int:
        """Micro-steps entered through ``accumulate`` in the current cycle (accelerate's counter)."""
        return self.gradient_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_state.step = value

    @property
    def sync_gradients(self) -> bool:
        """True on the steps where gradients are synchronised and the optimizer steps."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

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
        model_guards.check_one_device(model, self.num_processes)
        model_guards.check_trainable_dtype(model, self.mixed_precision)
        model_guards.warn_bf16_checkpoint(model, self.mixed_precision)
        place = self.device_placement if device_placement is None else device_placement
        if place and self.state.device_kind == "tpu":
            from notebook_launcher.accelerator import xla

            # Moving to XLA makes new Parameters: optimizers built before must follow them.
            self._parameter_swaps.update(xla.move_model(model, self.device))
            if self.num_processes > 1:
                xla.broadcast_module(model)  # what DDP does on other devices
        elif place:
            model = model.to(self.device)
        if self._precision.uses_fp8:
            self.fp8_layers = precision.convert_to_fp8(model)
        precision.patch_forward_with_autocast(model, self._precision)
        self._models.append(model)
        if self.num_processes == 1 or self.state.device_kind == "tpu":
            return model  # XLA reduces gradients in the optimizer step instead
        if self.fsdp_plugin is not None:
            self._parameter_swaps.update(shard_model(model, self.fsdp_plugin))
            self._step_clock.collectives_unknown = True  # FSDP2's collectives are not timed
            return model
        device_ids = [self.state.local_rank] if self.state.device_kind == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **self._ddp_kwargs)
        step_timing.time_ddp(ddp, self._step_clock)
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
            on_step=self._step_clock.step_ended,
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
            state=self.state.rank_state,
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
            split_batches=self.dataloader_config.split_batches,
            num_processes=self.num_processes,
        )
        self._schedulers.append(wrapped)
        return wrapped

    # ---- the training step ---------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled for fp16 and divided over accumulation steps."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        guard = self._checkpointing_guard
        guard.before_backward(loss, self._models)
        try:
            if self.scaler is not None:
                self.scaler.scale(loss).backward(**kwargs)
            else:
                loss.backward(**kwargs)
        except RuntimeError as error:
            explained = guard.explain(error)
            if explained is None:
                raise
            raise explained from error
        guard.after_backward(self._models)

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

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            state.step = 0  # the next epoch starts a fresh cycle
            state.sync_gradients = True
        else:
            state.step += 1
            state.sync_gradients = state.step % state.num_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every N-th or the last batch."""
        self._do_sync()
        allow_sync = self.gradient_state.sync_gradients or (
            self.use_distributed and self.gradient_state.sync_each_batch
        )
        with contextlib.ExitStack() as stack:
            if not allow_sync:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """The next backward all-reduces gradients even inside ``no_sync`` (e.g. after several forwards)."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        old_backward, old_forward = (
            model.require_backward_grad_sync,
            model.require_forward_param_sync,
        )
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        # DDP decides in forward whether to reduce; the forward already ran, so tell the reducer now.
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync = old_backward
            model.require_forward_param_sync = old_forward

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
            if self.state.device_kind == "tpu" and self.num_processes > 1:
                from notebook_launcher.accelerator import xla

                # No DDP on XLA: average before clipping, as DDP's backward did elsewhere.
                xla.reduce_gradients(o.optimizer for o in self._optimizers)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return full() if callable(full) else norm

    def clip_grad_value_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float
    ) -> None:
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def memory_summary(self) -> dict[str, Any]:
        """This rank's memory as plain data, the reading the launch's dashboard shows.

        ``kind`` ("rss" on a CPU rank, "cuda" on a GPU), ``peak_bytes``, ``current_bytes``,
        ``device``, and the bytes this rank holds of the prepared models' parameters
        (``trainable_parameters_bytes`` among them), gradients and optimizer state.
        """
        optimizers = [o.optimizer for o in self._optimizers]
        return memory_summary(self.process_index, self._models, optimizers)

    # ---- collectives -----------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        with step_timing.collective():
            return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions of a prepared loader's batch; on its last batch, drop the repeats.

        even_batches fills the last step with samples from the start of the data set;
        they are cut off here, so every sample is counted exactly once, in order. A batch
        mixing tensors and other values (a dict of tensors and strings) is joined sample-wise.
        """
        tensors_only = _all_tensors(input_data)
        structured = isinstance(input_data, Mapping) or (
            isinstance(input_data, (list, tuple)) and not operations._is_samples_list(input_data)
        )
        with step_timing.collective():
            if tensors_only and not use_gather_object:
                data: Any = operations.gather(input_data)
            elif structured:
                data = operations.concatenate(operations.gather_object([input_data]))
            else:
                # One value per rank (a number, a string) is gathered as one entry per rank.
                items = input_data if isinstance(input_data, (list, tuple)) else [input_data]
                data = operations.gather_object(items)
        loader = self.gradient_state.active_loader
        if loader is None or not loader.end_of_dataloader:
            return data
        real = loader.last_round_real_samples
        if real is None:
            return data
        if isinstance(data, list) and not tensors_only and not structured:
            return data[:real]
        return operations.slice_samples(data, 0, real)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        with step_timing.collective():
            return operations.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        return operations.pad_across_processes(
            tensor, dim=dim, pad_index=pad_index, pad_first=pad_first
        )

    def tqdm(self, *args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
        return _tqdm(*args, main_process_only=main_process_only, **kwargs)

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start the trackers named in ``log_with`` (on the main process) and record ``config``."""
        if not self.is_main_process:
            return
        self.trackers = start_trackers(
            self._log_with, project_name, self.logging_dir, init_kwargs or {}
        )
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its underlying object with unwrap=True)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        return None

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Record metrics of this rank: the launch's live plot gets every rank's, trackers the main one's."""
        self.logged.append({"step": step, **values})
        tracking.emit(self.process_index, step, values)
        for tracker in self.trackers:
            tracker.log(values, step=step, **dict((log_kwargs or {}).get(tracker.name, {})))

    # ---- models and checkpoints --------------------------------------------------------
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True
    ) -> torch.nn.Module:
        """The user's model inside DDP / torch.compile wrappers."""
        model = unwrap(model)
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
        """Close the trackers; leave the process group this Accelerator created (one made by others stays)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
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
