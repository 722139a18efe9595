"""``DataLoaderConfiguration(dispatch_batches=True)``: rank 0 reads, every rank gets its part.

For data only one process should read (a stream, a remote source, an iterable data set
without a way to shard it). Rank 0 iterates the user's loader and builds each step's
global batch: ``num_processes`` consecutive batches joined, or with ``split_batches=True``
one batch; it sends it to every rank, which keeps its contiguous part. The global order
is the same as without dispatching, so training still matches one process. With
``even_batches`` a short last step is filled with samples from the first step of the
epoch; ``gather_for_metrics`` drops them again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from notebook_launcher.accelerator import operations


class BatchDispatcher:
    """Splits rank 0's global batches; records how many samples of the last step are real."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        split_batches: bool,
        even_batches: bool,
        drop_last: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last = drop_last
        self.last_round_real_samples: int | None = None

    def steps(self, loader_batches: int) -> int:
        if self.split_batches:
            return loader_batches
        if self.drop_last:
            return loader_batches // self.world_size
        return -(-loader_batches // self.world_size)

    def batches(self, source: Iterator[Any] | None) -> Iterator[Any]:
        """This rank's batches; ``source`` (the user's loader) is read on rank 0 only."""
        self.last_round_real_samples = None
        per_step = 1 if self.split_batches else self.world_size
        first: Any = None
        round_size: int | None = None
        while True:
            payload: list[Any] = [None]
            if self.rank == 0 and source is not None:
                parts = [b for _, b in zip(range(per_step), source)]
                if parts and not (self.drop_last and len(parts) < per_step):
                    payload[0] = operations.concatenate(parts)
            operations.broadcast_object_list(payload, from_process=0)
            batch = payload[0]
            if batch is None:
                return
            size = operations.sample_count(batch)
            if round_size is None:
                first, round_size = batch, size
            self.last_round_real_samples = size
            if size < round_size and self.even_batches:
                batch = _fill(batch, first, size, round_size)
                size = round_size
            bounds = _bounds(size, self.world_size)[self.rank]
            yield operations.slice_samples(batch, *bounds)


def _fill(batch: Any, first: Any, size: int, round_size: int) -> Any:
    parts, have = [batch], size
    first_size = operations.sample_count(first)
    while have < round_size:
        take = min(first_size, round_size - have)
        parts.append(operations.slice_samples(first, 0, take))
        have += take
    return operations.concatenate(parts)


def _bounds(size: int, parts: int) -> list[tuple[int, int]]:
    share, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + share + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
