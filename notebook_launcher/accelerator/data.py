"""Preparing data loaders: sharded across ranks, batches moved to the device.

``prepare`` rebuilds the user's ``DataLoader`` around the same data set, collate
function and worker settings, with a batch sampler (or iterable data set) that yields
only this rank's share (see ``sharding``). The returned loader is still a
``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from notebook_launcher.accelerator import xla
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.operations import broadcast, send_to_device
from notebook_launcher.accelerator.sharding import (
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
)
from notebook_launcher.accelerator.state import RankState
from notebook_launcher.errors import ShardingError


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How prepared data loaders split the data, named as in accelerate.

    split_batches: the loader's batch_size is the global batch, cut into one part per
        rank (it must divide by the number of ranks). Otherwise every rank takes whole
        batches of batch_size, and the global batch is batch_size * num_processes.
    dispatch_batches: accepted for accelerate compatibility; only None/False (every rank
        reads its own shard) is supported.
    even_batches: fill the last step with samples from the start so every rank takes the
        same number of steps; gather_for_metrics drops those repeats again.
    use_seedable_sampler: shuffle with a sampler seeded by (data_seed, epoch), reproducible
        whatever else consumed random numbers; else shuffling follows torch's global RNG
        of rank 0, as one process would.
    data_seed: the seed of the seedable sampler (default: rank 0's torch.initial_seed()).
    non_blocking: copy batches to the GPU asynchronously (useful with pin_memory=True).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False


class DataLoaderShard(DataLoader):
    """A DataLoader yielding this rank's batches on the device, aware of its last batch."""

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | None,
        non_blocking: bool,
        gradient_state: GradientState,
        shard: ShardedBatchSampler | IterableDatasetShard | None,
        total_batch_size: int | None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.shard = shard
        self.total_batch_size = total_batch_size
        self.iteration = 0
        self._end_of_dataloader = False

    @property
    def end_of_dataloader(self) -> bool:
        return self._end_of_dataloader

    @property
    def last_round_real_samples(self) -> int | None:
        """Of the final step's global batch, the samples that are not even_batches repeats."""
        return self.shard.last_round_real_samples if self.shard is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of a seedable sampler or set_epoch-aware data set (as DistributedSampler does)."""
        self.iteration = epoch
        sampler = self._inner_sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _inner_sampler(self) -> Any:
        batch_sampler = self.batch_sampler
        if isinstance(batch_sampler, ShardedBatchSampler):
            batch_sampler = batch_sampler.batch_sampler
        return getattr(batch_sampler, "sampler", None)

    def _move(self, batch: Any) -> Any:
        if self.device is None or xla.active():  # torch_xla's loader moved it already
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if isinstance(self._inner_sampler(), SeedableRandomSampler):
            self.set_epoch(self.iteration)
        self._end_of_dataloader = False
        self.gradient_state.begin_loader(self)
        try:
            # One batch of look-ahead tells which batch is the last, before it is used,
            # so accumulation syncs on it and gather_for_metrics trims it.
            batches: Iterator[Any] = super().__iter__()
            if self.device is not None and xla.active():
                batches = xla.device_batches(batches, self.device)
            current = next(batches, _DONE)
            while current is not _DONE:
                following = next(batches, _DONE)
                if following is _DONE:
                    self._end_of_dataloader = True
                yield self._move(current)
                current = following
            self.iteration += 1
        finally:
            self.gradient_state.end_loader(self)


_DONE = object()

# Settings of the user's loader carried over to the rebuilt one, where this torch has them.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _carried_settings(loader: DataLoader) -> dict[str, Any]:
    accepted = inspect.signature(DataLoader.__init__).parameters
    settings = {
        name: getattr(loader, name)
        for name in _CARRIED
        if name in accepted and hasattr(loader, name)
    }
    if settings.get("num_workers", 0) == 0:
        # torch rejects these two without workers, even at their "unset" values.
        settings.pop("prefetch_factor", None)
        settings.pop("persistent_workers", None)
    return settings


def prepare_data_loader(
    loader: DataLoader,
    *,
    state: RankState,
    config: DataLoaderConfiguration,
    gradient_state: GradientState,
    device_placement: bool,
) -> DataLoaderShard:
    if config.dispatch_batches:
        raise ShardingError(
            "DataLoaderConfiguration(dispatch_batches=True) (rank 0 reads every batch and sends "
            "each rank its part) is not supported: every rank reads its own shard. Pass "
            "dispatch_batches=None."
        )
    device = state.device if device_placement else None
    common: dict[str, Any] = {
        "device": device,
        "non_blocking": config.non_blocking,
        "gradient_state": gradient_state,
        **_carried_settings(loader),
    }
    world_size, rank = state.world_size, state.rank
    if isinstance(loader.dataset, IterableDataset):
        return _prepare_iterable(loader, state, config, common)

    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise ShardingError(
            "This DataLoader has batch_size=None (no batching), so it cannot be split into "
            "per-rank batches; give it a batch_size."
        )
    batch_size = getattr(batch_sampler, "batch_size", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if (
        config.use_seedable_sampler
        and isinstance(sampler, RandomSampler)
        and isinstance(batch_sampler, BatchSampler)
    ):
        seed = config.data_seed if config.data_seed is not None else _rank0_initial_seed(state)
        sampler = SeedableRandomSampler(
            sampler.data_source,
            seed=seed,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
        )
        batch_sampler = BatchSampler(
            sampler, batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last
        )

    shard: ShardedBatchSampler | None = None
    total_batch_size = batch_size
    if world_size > 1 and not isinstance(sampler, DistributedSampler):
        if config.split_batches and (batch_size is None or batch_size % world_size):
            raise ShardingError(
                f"split_batches=True cuts each batch of the loader into {world_size} parts "
                f"(one per rank), but its batch_size is {batch_size}; use a batch_size "
                f"divisible by {world_size}, or split_batches=False."
            )
        shard = ShardedBatchSampler(
            batch_sampler,
            rank=rank,
            world_size=world_size,
            split_batches=config.split_batches,
            even_batches=config.even_batches,
            device=state.device,
        )
        batch_sampler = shard
        total_batch_size = shard.round_size
    elif world_size > 1 and batch_size is not None:
        total_batch_size = batch_size * world_size  # the user's DistributedSampler already shards
    return DataLoaderShard(
        loader.dataset,
        batch_sampler=batch_sampler,
        shard=shard,
        total_batch_size=total_batch_size,
        **common,
    )


def _prepare_iterable(
    loader: DataLoader,
    state: RankState,
    config: DataLoaderConfiguration,
    common: dict[str, Any],
) -> DataLoaderShard:
    batch_size = loader.batch_size
    if batch_size is None:
        raise ShardingError(
            "This DataLoader over an IterableDataset has batch_size=None, so it cannot be "
            "split into per-rank batches; give it a batch_size."
        )
    if state.world_size == 1:
        return DataLoaderShard(
            loader.dataset,
            batch_size=batch_size,
            drop_last=loader.drop_last,
            shard=None,
            total_batch_size=batch_size,
            **common,
        )
    if config.split_batches and batch_size % state.world_size:
        raise ShardingError(
            f"split_batches=True cuts each batch of the loader into {state.world_size} parts "
            f"(one per rank), but its batch_size is {batch_size}; use a batch_size divisible "
            f"by {state.world_size}, or split_batches=False."
        )
    shard = IterableDatasetShard(
        loader.dataset,
        batch_size=batch_size,
        rank=state.rank,
        world_size=state.world_size,
        split_batches=config.split_batches,
        even_batches=config.even_batches,
        drop_last=loader.drop_last,
    )
    return DataLoaderShard(
        shard,
        batch_size=shard.per_rank,
        drop_last=False,
        shard=shard,
        total_batch_size=shard.round_size,
        **common,
    )


def _rank0_initial_seed(state: RankState) -> int:
    # Ranks that never called set_seed have different initial seeds: agree on rank 0's.
    seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64)
    if state.backend == "nccl":
        seed = seed.to(state.device)
    return int(broadcast(seed)[0])
