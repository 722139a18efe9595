"""The Accelerator's methods around the training loop: uneven inputs, memory, profiling.

A mixin over the Accelerator's prepared objects, named as in accelerate: ``join_uneven_inputs``,
``even_batches``, ``free_memory`` / ``clear``, ``profile``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from notebook_launcher.accelerator.kwargs import ProfileKwargs
from notebook_launcher.accelerator.rank_state import DistributedType

if TYPE_CHECKING:
    from notebook_launcher.accelerator.accelerator_state import AcceleratorState
    from notebook_launcher.accelerator.data import DataLoaderConfiguration, DataLoaderShard
    from notebook_launcher.accelerator.optimizer import AcceleratedOptimizer
    from notebook_launcher.accelerator.scheduler import AcceleratedScheduler

# Where DDP's Join runs: torch's Join works over gloo as over NCCL (accelerate allows GPUs only).
_JOINABLE = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


class Lifecycle:
    state: AcceleratorState
    dataloader_config: DataLoaderConfiguration
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[DataLoaderShard]
    _profile_kwargs: ProfileKwargs | None = None

    # ---- uneven inputs -------------------------------------------------------------
    @property
    def even_batches(self) -> bool:
        """Whether prepared loaders fill the last step so every rank takes as many steps."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Ranks with fewer batches shadow the others' collectives (torch's ``Join``) until all finish.

        ``even_batches`` overrides the loaders' setting inside the block (map-style loaders only).
        Runs on several CPU ranks too (accelerate's runs on GPUs only).
        """
        if not (self.state.use_distributed and self.state.distributed_type in _JOINABLE):
            if self.state.distributed_type != DistributedType.NO:
                warnings.warn(
                    "join_uneven_inputs is only supported for multi-GPU and multi-CPU DDP "
                    f"training (this run is {self.state.distributed_type.value}), so it has no "
                    "effect here.",
                    UserWarning,
                    stacklevel=3,
                )
            yield
            return
        from torch.distributed.algorithms.join import Join

        from notebook_launcher.accelerator.data_sharding import ShardedBatchSampler

        restore: list[tuple[ShardedBatchSampler, bool]] = []
        if even_batches is not None:
            iterable_seen = False
            for loader in self._dataloaders:
                if not isinstance(loader.shard, ShardedBatchSampler):
                    iterable_seen = True
                    continue
                restore.append((loader.shard, loader.shard.even_batches))
                loader.shard.even_batches = even_batches
            if iterable_seen:
                warnings.warn(
                    "Overriding even_batches is only supported for map-style datasets; the "
                    "loaders over iterable data sets (or dispatching batches) keep their setting.",
                    UserWarning,
                    stacklevel=3,
                )
        else:
            even_batches = self.even_batches
        try:
            with Join(list(joinables), enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for shard, value in restore:
                shard.even_batches = value

    # ---- memory --------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[Any]:
        """Forget every prepared object and free what they held; returns ``[None] * len(objects)``.

        Use it between two runs in one process (e.g. a batch-size search):
        ``model, optimizer = accelerator.free_memory(model, optimizer)``.
        """
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.gradient_state_reset()
        released: list[Any] = [None] * len(objects)
        del objects
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return released

    def clear(self, *objects: Any) -> list[Any]:
        """The same as ``free_memory``."""
        return self.free_memory(*objects)

    def gradient_state_reset(self) -> None:
        gradient_state = getattr(self, "gradient_state", None)
        if gradient_state is not None:
            gradient_state.step = 0
            gradient_state.sync_gradients = True

    # ---- profiling -----------------------------------------------------------------
    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """``torch.profiler.profile`` set up from ``ProfileKwargs``; yields the profiler.

        With ``output_trace_dir`` each rank writes ``trace_rank<r>.json`` when the block ends.
        """
        handler = profile_handler or self._profile_kwargs or ProfileKwargs()
        activities = _activities(handler.activities, self.state.device_kind)
        schedule = (
            torch.profiler.schedule(**handler.schedule_option)
            if handler.schedule_option is not None
            else None
        )
        with torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=handler.on_trace_ready,
            record_shapes=handler.record_shapes,
            profile_memory=handler.profile_memory,
            with_stack=handler.with_stack,
            with_flops=handler.with_flops,
            with_modules=handler.with_modules,
        ) as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            name = f"trace_rank{self.state.process_index}.json"
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))


def _activities(names: list[str] | None, device_kind: str) -> list[Any]:
    known = {
        "cpu": torch.profiler.ProfilerActivity.CPU,
        "cuda": torch.profiler.ProfilerActivity.CUDA,
    }
    if names is None:
        names = ["cpu", "cuda"] if device_kind == "cuda" else ["cpu"]
    unknown = [n for n in names if n not in known]
    if unknown:
        from notebook_launcher.errors import AcceleratorError

        raise AcceleratorError(
            f"ProfileKwargs(activities={names!r}): {', '.join(map(repr, unknown))} is not an "
            "activity this core profiles; use 'cpu' and/or 'cuda'."
        )
    return [known[n] for n in names]
