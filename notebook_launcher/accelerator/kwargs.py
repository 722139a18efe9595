"""Settings objects passed to ``Accelerator(kwargs_handlers=[...])``, named as in accelerate.

Each handler turns into keyword arguments for one torch constructor. Only the fields a
user changed are passed on, so torch's own defaults apply to everything else (and a
torch release that changes a default is followed rather than overridden).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass
class KwargsHandler:
    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from this class's defaults."""
        default = type(self)()
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(default, field.name)
        }


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` around the forward pass."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (used with mixed_precision="fp16")."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate: ``Accelerator(gradient_accumulation_plugin=...)``, as in accelerate.

    num_steps: micro-batches per optimizer step.
    adjust_scheduler: count the skipped micro-steps in a prepared LR scheduler's step
        counter (accelerate's behaviour; the learning rate itself changes on real steps only).
    sync_with_dataloader: the last batch of a prepared loader always ends a cycle.
    sync_each_batch: all-reduce gradients on every micro-batch (less memory, more traffic);
        the optimizer still steps every num_steps.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """Shard the model with FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of DDP.

    ``shard_module_types``: the submodule classes that become their own FSDP unit (for
    a transformer, its block class). When None, a transformers model's blocks (the classes
    it names in ``_no_split_modules``, found through wrappers such as peft's) are the
    units; a model naming none has each direct child that holds parameters as a unit.
    The root module is always sharded last.
    """

    reshard_after_forward: bool = True
    shard_module_types: tuple[type[torch.nn.Module], ...] | None = None
    # Called on each submodule; True makes it an FSDP unit. Overrides shard_module_types.
    shard_module_filter: Callable[[torch.nn.Module], bool] | None = None


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments for ``Accelerator.profile()`` (``torch.profiler.profile``), named as in accelerate.

    activities: "cpu", "cuda" (default: the CPU, and CUDA when ranks run on GPUs).
    schedule_option: ``torch.profiler.schedule`` arguments (wait, warmup, active, repeat,
    skip_first). output_trace_dir: each rank writes ``trace_rank<r>.json`` (Chrome trace)
    there when the block ends.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


KWARGS_HANDLER_TYPES: tuple[type[KwargsHandler], ...] = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    ProfileKwargs,
)
