"""The shared training core: ``Accelerator`` and its settings, following accelerate's API."""

from __future__ import annotations

from notebook_launcher.accelerator.accelerator import Accelerator
from notebook_launcher.accelerator.accelerator_state import AcceleratorState, PartialState
from notebook_launcher.accelerator.checkpointing import ProjectConfiguration
from notebook_launcher.accelerator.data import DataLoaderConfiguration
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProfileKwargs,
)
from notebook_launcher.accelerator.operations import (
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from notebook_launcher.accelerator.rank_state import DistributedType
from notebook_launcher.accelerator.trackers import GeneralTracker, TensorBoardTracker
from notebook_launcher.accelerator.utils import set_seed, tqdm
from notebook_launcher.errors import (
    AcceleratorError,
    CheckpointError,
    CollectiveError,
    CollectiveTypeError,
    DistributedOperationException,
    MissingDependencyError,
    MixedPrecisionError,
    RankEnvironmentError,
    ShardingError,
    TrackerError,
)
from notebook_launcher.tracking import add_metric_sink, remove_metric_sink

__all__ = [
    "Accelerator",
    "AcceleratorError",
    "AcceleratorState",
    "AutocastKwargs",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTypeError",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "MissingDependencyError",
    "MixedPrecisionError",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RankEnvironmentError",
    "ShardingError",
    "TensorBoardTracker",
    "TrackerError",
    "add_metric_sink",
    "broadcast",
    "broadcast_object_list",
    "copy_tensor_to_devices",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "remove_metric_sink",
    "send_to_device",
    "set_seed",
    "tqdm",
]
