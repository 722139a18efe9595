"""Splitting a data loader's samples across ranks.

Global order is preserved: with ``split_batches=False`` rank r takes batches r, r+W,
r+2W, ... of the original batch sampler (per-rank batch B, global batch W*B); with
``split_batches=True`` every original batch is cut into W equal parts. Either way the
W per-rank batches of one step, concatenated in rank order, are exactly the batch one
process would see, which is what makes N-rank training match one process.

With ``even_batches=True`` the last, short step is filled with samples from the start of
the epoch so every rank takes the same number of steps (DDP needs that); each shard
records how many samples of that step are real, so ``gather_for_metrics`` can drop
the repeats.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, RandomSampler, Sampler


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on (seed, epoch): the same on every rank."""

    def __init__(
        self,
        data_source: Sized,
        *,
        seed: int,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()


def _pad_cyclic(indices: list[Any], start_of_epoch: list[Any], size: int) -> list[Any]:
    source = start_of_epoch or indices
    padded = list(indices)
    i = 0
    while len(padded) < size:
        padded.append(source[i % len(source)])
        i += 1
    return padded


def _chunks(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    pieces, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        pieces.append(items[start:end])
        start = end
    return pieces


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's batches of a map-style data loader's batch sampler."""

    def __init__(
        self,
        batch_sampler: Any,
        *,
        rank: int,
        world_size: int,
        split_batches: bool,
        even_batches: bool,
        device: torch.device,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.device = device
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        self.last_round_real_samples: int | None = None
        # What fixed the current epoch's shuffle, so a resumed run replays the same order.
        self.epoch_start: tuple[str, Any] | None = None
        self._replay: tuple[str, Any] | None = None

    @property
    def sampler(self) -> Any:
        """The inner batch sampler's sampler (code reading ``loader.batch_sampler.sampler`` keeps working)."""
        return getattr(self.batch_sampler, "sampler", None)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_start": self.epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass replays the saved epoch's shuffle instead of drawing a new one."""
        self._replay = state.get("epoch_start")

    @property
    def round_size(self) -> int | None:
        """Samples in one step across all ranks (the global batch)."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.world_size

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return batches
        if self.drop_last:
            return batches // self.world_size
        if self.even_batches:
            return -(-batches // self.world_size)
        return max(0, -(-(batches - self.rank) // self.world_size))

    def __iter__(self) -> Iterator[list[int]]:
        self.last_round_real_samples = None
        batches = self._synchronised_batches()
        if self.world_size == 1:
            # Nothing to split or pad: this wrapper only records the epoch's shuffle.
            yield from batches
            return
        round_size = self.round_size
        start_of_epoch: list[int] = []
        pending: list[list[int]] = []
        for batch in batches:
            batch = list(batch)
            if round_size is not None and len(start_of_epoch) < round_size:
                start_of_epoch.extend(batch[: round_size - len(start_of_epoch)])
            if self.split_batches:
                if len(batch) == self.batch_size:
                    self.last_round_real_samples = len(batch)
                    yield _chunks(batch, self.world_size)[self.rank]
                else:
                    yield from self._last_round([batch], start_of_epoch)
                continue
            pending.append(batch)
            if len(pending) == self.world_size:
                if all(len(b) == self.batch_size for b in pending) or self.batch_size is None:
                    self.last_round_real_samples = sum(len(b) for b in pending)
                    yield pending[self.rank]
                else:
                    yield from self._last_round(pending, start_of_epoch)
                pending = []
        if pending and not self.drop_last:
            yield from self._last_round(pending, start_of_epoch)

    def _last_round(
        self, batches: list[list[int]], start_of_epoch: list[int]
    ) -> Iterator[list[int]]:
        flat = [i for b in batches for i in b]
        self.last_round_real_samples = len(flat)
        round_size = self.round_size
        if self.even_batches and round_size is not None:
            mine = _chunks(_pad_cyclic(flat, start_of_epoch, round_size), self.world_size)[
                self.rank
            ]
        elif self.split_batches:
            mine = _chunks(flat, self.world_size)[self.rank]
        else:
            mine = batches[self.rank] if self.rank < len(batches) else []
        if mine:
            yield mine

    def _synchronised_batches(self) -> Iterator[Any]:
        """The inner batches, shuffled identically on every rank.

        Without this each rank's RandomSampler would draw its own order and samples would
        be seen twice or never. For a sampler without a generator, every rank draws a seed
        exactly as torch's RandomSampler does (so the global RNG advances the same as in
        one process) and rank 0's seed is used; a sampler with its own generator gets rank
        0's generator state.
        """
        sampler = getattr(self.batch_sampler, "sampler", None)
        replay, self._replay = self._replay, None
        if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
            self.epoch_start = None
            return iter(self.batch_sampler)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if sampler.generator is not None:
            if replay is not None:
                sampler.generator.set_state(replay[1])
            elif distributed:
                sampler.generator.set_state(self._broadcast(sampler.generator.get_state()))
            self.epoch_start = ("generator", sampler.generator.get_state())
            return iter(self.batch_sampler)
        if replay is not None:
            seed = int(replay[1])
        else:
            # Drawn exactly as torch's RandomSampler draws it, so one process shuffles as without us.
            drawn = torch.empty((), dtype=torch.int64).random_()
            seed = int(self._broadcast(drawn.reshape(1))[0]) if distributed else int(drawn)
        self.epoch_start = ("seed", seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        return self._with_generator(sampler, generator)

    def _with_generator(self, sampler: RandomSampler, generator: torch.Generator) -> Iterator[Any]:
        sampler.generator = generator
        try:
            inner = iter(self.batch_sampler)
            first = next(inner, None)  # the sampler has read its generator once it yields
        finally:
            sampler.generator = None
        if first is None:
            return
        yield first
        yield from inner

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL only moves device tensors; gloo takes CPU ones.
        on_device = dist.get_backend() == "nccl"
        work = tensor.to(self.device) if on_device else tensor.clone()
        dist.broadcast(work, src=0)
        return work.cpu() if on_device else work


class IterableDatasetShard(IterableDataset):
    """This rank's items of an iterable data set: every rank reads it all and keeps its slice."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        split_batches: bool,
        even_batches: bool,
        drop_last: bool,
    ) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.round_size = batch_size if split_batches else batch_size * world_size
        self.per_rank = self.round_size // world_size
        self.even_batches = even_batches
        self.drop_last = drop_last
        self.last_round_real_samples: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        total = len(self.dataset)
        rounds = total // self.round_size if self.drop_last else -(-total // self.round_size)
        return rounds * self.per_rank

    def __iter__(self) -> Iterator[Any]:
        self.last_round_real_samples = None
        start_of_epoch: list[Any] = []
        buffer: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == self.round_size:
                if not start_of_epoch:
                    start_of_epoch = buffer
                self.last_round_real_samples = len(buffer)
                yield from buffer[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
                buffer = []
        if not buffer or self.drop_last:
            return
        self.last_round_real_samples = len(buffer)
        if self.even_batches:
            buffer = _pad_cyclic(buffer, start_of_epoch, self.round_size)
            yield from buffer[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        else:
            yield from _chunks(buffer, self.world_size)[self.rank]


class SkipBatches(Sampler[list[int]]):
    """A batch sampler without the first ``skip`` batches of each pass (for resuming mid-epoch)."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)
