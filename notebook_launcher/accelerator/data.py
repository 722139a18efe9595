"""Preparing data loaders: sharded across ranks, batches moved to the device.

``prepare`` rebuilds the user's ``DataLoader`` around the same data set, collate
function and worker settings, with a batch sampler (or iterable data set) that yields
only this rank's share (see ``data_sharding``). The returned loader is still a
``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from notebook_launcher.accelerator import step_timing, xla
from notebook_launcher.accelerator.data_sharding import (
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
    SkipBatches,
)
from notebook_launcher.accelerator.dispatch import BatchDispatcher
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.operations import broadcast, send_to_device
from notebook_launcher.accelerator.rank_state import RankState
from notebook_launcher.errors import ShardingError


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How prepared data loaders split the data, named as in accelerate.

    split_batches: the loader's batch_size is the global batch, cut into one part per
        rank (it must divide by the number of ranks). Otherwise every rank takes whole
        batches of batch_size, and the global batch is batch_size * num_processes.
    dispatch_batches: rank 0 reads every batch and sends each rank its part (for data
        only one process should read); None/False: every rank reads its own shard.
    even_batches: fill the last step with samples from the start so every rank takes the
        same number of steps; gather_for_metrics drops those repeats again.
    use_seedable_sampler: shuffle with a sampler seeded by (data_seed, epoch), reproducible
        whatever else consumed random numbers; else shuffling follows torch's global RNG
        of rank 0, as one process would.
    data_seed: the seed of the seedable sampler (default: rank 0's torch.initial_seed()).
    non_blocking: copy batches to the GPU asynchronously (useful with pin_memory=True).
    use_stateful_dataloader: a prepared loader resumes where its ``state_dict()`` was taken:
        after ``load_state_dict`` (or ``load_state``) its next pass continues the saved
        epoch, with its shuffle, after the batches already taken.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


class DataLoaderShard(DataLoader):
    """A DataLoader yielding this rank's batches on the device, aware of its last batch."""

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | None,
        non_blocking: bool,
        gradient_state: GradientState,
        shard: ShardedBatchSampler | IterableDatasetShard | BatchDispatcher | None,
        total_batch_size: int | None,
        stateful: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        self.stateful = stateful
        self._resume_skip = 0  # batches of the saved pass already taken (stateful resume)
        self._pass_skip = 0  # of those, what the current pass leaves out
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = gradient_state
        self.shard = shard
        self.total_batch_size = total_batch_size
        self.iteration = 0
        self.batches_yielded = 0  # in the current pass
        self._end_of_dataloader = False
        self._origin: DataLoaderShard | None = None  # set on a skip_first_batches view
        self._skip_after_collate = 0
        self._resuming = False

    @property
    def end_of_dataloader(self) -> bool:
        return self._end_of_dataloader

    @property
    def last_round_real_samples(self) -> int | None:
        """Of the final step's global batch, the samples that are not even_batches repeats."""
        return self.shard.last_round_real_samples if self.shard is not None else None

    @property
    def remainder(self) -> int:
        real = self.last_round_real_samples
        return -1 if real is None else real

    def _owner(self) -> DataLoaderShard:
        return self._origin if self._origin is not None else self

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of a seedable sampler or set_epoch-aware data set (as DistributedSampler does)."""
        self._owner().iteration = epoch
        sampler = self._inner_sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _inner_sampler(self) -> Any:
        batch_sampler = self.batch_sampler if self.batch_sampler is not None else self.sampler
        while isinstance(batch_sampler, (ShardedBatchSampler, SkipBatches)):
            batch_sampler = batch_sampler.batch_sampler
        return getattr(batch_sampler, "sampler", None)

    def _xla_loader(self) -> bool:
        """Batches reach the XLA device through torch_xla's parallel loader.

        Not dispatched ones: dispatching runs collectives, which belong in the replica's
        own thread, not the loader's.
        """
        return (
            self.device is not None and xla.active() and not isinstance(self.shard, BatchDispatcher)
        )

    def _move(self, batch: Any) -> Any:
        if self.device is None or self._xla_loader():  # torch_xla's loader moved it already
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __len__(self) -> int:
        if isinstance(self.shard, BatchDispatcher):
            return max(0, self.shard.steps(super().__len__()) - self._skip_after_collate)
        return max(0, super().__len__() - self._skip_after_collate)

    def _source(self) -> Iterator[Any]:
        if isinstance(self.shard, BatchDispatcher):
            reader = super().__iter__() if self.shard.rank == 0 else None
            batches: Iterator[Any] = self.shard.batches(reader)
        else:
            batches = super().__iter__()
        skip = self._skip_after_collate + self._pass_skip
        for i, batch in enumerate(batches):
            if i >= skip:
                yield batch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        owner = self._owner()
        if isinstance(self._inner_sampler(), SeedableRandomSampler):
            self.set_epoch(owner.iteration)
        self._end_of_dataloader = False
        self._pass_skip = owner._resume_skip
        owner._resume_skip = 0
        self.batches_yielded = self._pass_skip
        self.gradient_state.begin_loader(self)
        # A resumed pass must leave torch's RNG as the interrupted run left it: the sampler
        # replays the saved shuffle instead of drawing, and the draw DataLoader makes for
        # worker seeds is undone.
        rng = torch.get_rng_state() if owner._resuming else None
        owner._resuming = False
        try:
            # One batch of look-ahead tells which batch is the last, before it is used,
            # so accumulation syncs on it and gather_for_metrics trims it.
            batches: Iterator[Any] = self._source()
            if self.device is not None and self._xla_loader():
                batches = xla.device_batches(batches, self.device)
            current = next(batches, _DONE)
            if rng is not None:
                torch.set_rng_state(rng)
            while current is not _DONE:
                asked = time.perf_counter()
                following = next(batches, _DONE)
                step_timing.add_data_wait(time.perf_counter() - asked)
                if following is _DONE:
                    self._end_of_dataloader = True
                self.batches_yielded += 1
                yield self._move(current)
                current = following
            owner.iteration += 1
        finally:
            self.gradient_state.end_loader(self)

    # ---- resuming ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: its epoch, the current epoch's shuffle, batches taken in it."""
        owner = self._owner()
        sampler = self._inner_sampler()
        shard_state = self.shard.state_dict() if isinstance(self.shard, ShardedBatchSampler) else {}
        return {
            "iteration": owner.iteration,
            "batches_yielded": self.batches_yielded,
            "shard": shard_state,
            "seed": getattr(sampler, "seed", None)
            if isinstance(sampler, SeedableRandomSampler)
            else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict saved: the next pass repeats the saved epoch's shuffle."""
        self.iteration = int(state.get("iteration", 0))
        self.batches_yielded = int(state.get("batches_yielded", 0))
        if isinstance(self.shard, ShardedBatchSampler) and state.get("shard"):
            self.shard.load_state_dict(state["shard"])
        sampler = self._inner_sampler()
        if isinstance(sampler, SeedableRandomSampler) and state.get("seed") is not None:
            sampler.seed = int(state["seed"])
        self._resuming = True
        if self.stateful:
            self._owner()._resume_skip = self.batches_yielded

    def skipping(self, num_batches: int) -> DataLoaderShard:
        """A view of this loader that leaves out the first ``num_batches`` of each pass."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ShardingError(
                f"skip_first_batches(..., num_batches={num_batches!r}); it must be an integer >= 0."
            )
        view = copy.copy(self)
        view._origin = self._owner()
        view._iterator = None  # never share a persistent-workers iterator with the original
        if isinstance(self.shard, ShardedBatchSampler) and self.batch_sampler is self.shard:
            # Skipped at the index level: the skipped samples are never loaded.
            view.__dict__["batch_sampler"] = SkipBatches(self.shard, num_batches)
        else:
            view._skip_after_collate = num_batches
        return view


def skip_plain_loader(loader: DataLoader, num_batches: int) -> Any:
    """skip_first_batches for a DataLoader that was not prepared."""
    if loader.batch_sampler is not None and not isinstance(loader.dataset, IterableDataset):
        return DataLoader(
            loader.dataset,
            batch_sampler=SkipBatches(loader.batch_sampler, num_batches),
            **_carried_settings(loader),
        )
    return _SkipIterable(loader, num_batches)


class _SkipIterable:
    def __init__(self, loader: Any, skip: int) -> None:
        self.loader, self.skip = loader, skip

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.skip)


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
    device = state.device if device_placement else None
    common: dict[str, Any] = {
        "device": device,
        "non_blocking": config.non_blocking,
        "gradient_state": gradient_state,
        "stateful": config.use_stateful_dataloader,
        **_carried_settings(loader),
    }
    world_size, rank = state.world_size, state.rank
    if config.dispatch_batches and world_size > 1:
        return _prepare_dispatched(loader, state, config, common)
    if isinstance(loader.dataset, IterableDataset):
        return _prepare_iterable(loader, state, config, common)

    batch_sampler = loader.batch_sampler
    # DataLoader(sampler=BatchSampler(...), batch_size=None): the data set fetches a whole
    # batch of indices at once; the batch sampler is sharded and stays in the sampler slot.
    batches_as_samples = batch_sampler is None and isinstance(loader.sampler, BatchSampler)
    if batches_as_samples:
        batch_sampler = loader.sampler
    if batch_sampler is None:
        raise ShardingError(
            "This DataLoader has batch_size=None (no batching), so it cannot be split into "
            "per-rank batches; give it a batch_size, or a BatchSampler as its sampler."
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
    # One process is wrapped too: the wrapper records each epoch's shuffle for resuming.
    if not isinstance(sampler, DistributedSampler):
        if (
            world_size > 1
            and config.split_batches
            and (batch_size is None or batch_size % world_size)
        ):
            raise ShardingError(
                f"split_batches=True cuts each batch of the loader into {world_size} parts "
                f"(one per rank), but its batch_size is {batch_size}; use a batch_size "
                f"divisible by {world_size}, or split_batches=False."
            )
        shard = ShardedBatchSampler(
            batch_sampler,
            rank=rank,
            world_size=world_size,
            split_batches=config.split_batches and world_size > 1,
            even_batches=config.even_batches and world_size > 1,
            device=state.device,
        )
        batch_sampler = shard
        total_batch_size = shard.round_size
    elif world_size > 1 and batch_size is not None:
        total_batch_size = batch_size * world_size  # the user's DistributedSampler already shards
    if batches_as_samples:
        return DataLoaderShard(
            loader.dataset,
            sampler=batch_sampler,
            batch_size=None,
            shard=shard,
            total_batch_size=total_batch_size,
            **common,
        )
    return DataLoaderShard(
        loader.dataset,
        batch_sampler=batch_sampler,
        shard=shard,
        total_batch_size=total_batch_size,
        **common,
    )


def _batch_size(
    loader: DataLoader, state: RankState, config: DataLoaderConfiguration, unbatched: str
) -> int:
    """The loader's batch size, which its batches are split by (``unbatched``: why None fails)."""
    batch_size = loader.batch_size
    if batch_size is None:
        raise ShardingError(unbatched)
    if config.split_batches and batch_size % state.world_size:
        raise ShardingError(
            f"split_batches=True cuts each batch of the loader into {state.world_size} parts "
            f"(one per rank), but its batch_size is {batch_size}; use a batch_size divisible "
            f"by {state.world_size}, or split_batches=False."
        )
    return batch_size


def _prepare_dispatched(
    loader: DataLoader,
    state: RankState,
    config: DataLoaderConfiguration,
    common: dict[str, Any],
) -> DataLoaderShard:
    batch_size = _batch_size(
        loader,
        state,
        config,
        "dispatch_batches=True splits the loader's batches between the ranks, but this "
        "DataLoader has batch_size=None (no batching); give it a batch_size.",
    )
    dispatcher = BatchDispatcher(
        rank=state.rank,
        world_size=state.world_size,
        split_batches=config.split_batches,
        even_batches=config.even_batches,
        drop_last=loader.drop_last,
    )
    if isinstance(loader.dataset, IterableDataset):
        kwargs: dict[str, Any] = {"batch_size": batch_size, "drop_last": loader.drop_last}
    else:
        kwargs = {"batch_sampler": loader.batch_sampler}
    return DataLoaderShard(
        loader.dataset,
        shard=dispatcher,
        total_batch_size=batch_size if config.split_batches else batch_size * state.world_size,
        **kwargs,
        **common,
    )


def _prepare_iterable(
    loader: DataLoader,
    state: RankState,
    config: DataLoaderConfiguration,
    common: dict[str, Any],
) -> DataLoaderShard:
    batch_size = _batch_size(
        loader,
        state,
        config,
        "This DataLoader over an IterableDataset has batch_size=None, so it cannot be "
        "split into per-rank batches; give it a batch_size.",
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
