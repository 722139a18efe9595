"""The shared training core: ``Accelerator`` and its settings, following accelerate's API."""

from __future__ import annotations

from notebook_launcher.accelerator.accelerator import Accelerator
from notebook_launcher.accelerator.data import DataLoaderConfiguration
from notebook_launcher.accelerator.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
)
from notebook_launcher.accelerator.state import DistributedType
from notebook_launcher.accelerator.utils import set_seed, tqdm
from notebook_launcher.errors import (
    AcceleratorError,
    MissingDependencyError,
    MixedPrecisionError,
    RankEnvironmentError,
    ShardingError,
)
from notebook_launcher.tracking import add_metric_sink, remove_metric_sink

__all__ = [
    "Accelerator",
    "AcceleratorError",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "MissingDependencyError",
    "MixedPrecisionError",
    "RankEnvironmentError",
    "ShardingError",
    "add_metric_sink",
    "remove_metric_sink",
    "set_seed",
    "tqdm",
]
