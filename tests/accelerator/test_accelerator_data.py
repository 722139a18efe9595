"""Sharding data loaders across ranks: every sample once per epoch, in the global order."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

from notebook_launcher.accelerator import Accelerator, DataLoaderConfiguration, ShardingError
from notebook_launcher.accelerator.data import DataLoaderShard, prepare_data_loader
from notebook_launcher.accelerator.data_sharding import (
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
)
from notebook_launcher.accelerator.gradient_state import GradientState
from notebook_launcher.accelerator.rank_state import RankState
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def shards(
    n: int,
    batch_size: int,
    world_size: int,
    *,
    drop_last: bool = False,
    split_batches: bool = False,
    even_batches: bool = True,
) -> tuple[list[list[list[int]]], int | None]:
    """Each rank's batches of range(n), and the real samples of the last step."""
    per_rank, real = [], None
    for rank in range(world_size):
        sampler = ShardedBatchSampler(
            BatchSampler(SequentialSampler(range(n)), batch_size, drop_last),
            rank=rank,
            world_size=world_size,
            device=torch.device("cpu"),
            split_batches=split_batches,
            even_batches=even_batches,
        )
        per_rank.append(list(sampler))
        assert len(sampler) == len(per_rank[-1])
        real = sampler.last_round_real_samples
    return per_rank, real


def test_ranks_take_alternate_batches_and_the_last_step_is_padded_from_the_start() -> None:
    (rank0, rank1), real = shards(10, 3, 2)
    assert rank0 == [[0, 1, 2], [6, 7, 8]]
    assert rank1 == [[3, 4, 5], [9, 0, 1]]
    assert real == 4  # of the last step's 6 samples, 4 are not repeats


def test_without_even_batches_the_last_rank_gets_a_short_batch() -> None:
    (rank0, rank1), real = shards(10, 3, 2, even_batches=False)
    assert rank0 == [[0, 1, 2], [6, 7, 8]]
    assert rank1 == [[3, 4, 5], [9]]
    assert real == 4


def test_drop_last_drops_the_incomplete_last_step() -> None:
    (rank0, rank1), _ = shards(10, 3, 2, drop_last=True)
    assert rank0 == [[0, 1, 2]] and rank1 == [[3, 4, 5]]


def test_split_batches_cuts_each_batch_into_one_part_per_rank() -> None:
    (rank0, rank1), real = shards(10, 4, 2, split_batches=True)
    assert rank0 == [[0, 1], [4, 5], [8, 9]]
    assert rank1 == [[2, 3], [6, 7], [0, 1]]
    assert real == 2


def test_a_data_set_smaller_than_one_step_is_repeated_to_fill_it() -> None:
    (rank0, rank1), real = shards(2, 3, 2)
    assert rank0 == [[0, 1, 0]] and rank1 == [[1, 0, 1]]
    assert real == 2


@pytest.mark.parametrize("split_batches", [False, True])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_sample_is_seen_exactly_once_in_order_after_dropping_repeats(
    world_size: int, split_batches: bool
) -> None:
    for n, batch_size in itertools.product(range(1, 14), range(1, 5)):
        if split_batches:
            batch_size *= world_size
        per_rank, real = shards(n, batch_size, world_size, split_batches=split_batches)
        steps = {len(batches) for batches in per_rank}
        assert len(steps) == 1, f"ranks take different numbers of steps for n={n}"
        seen: list[int] = []
        for step in range(steps.pop()):
            seen += [i for batches in per_rank for i in batches[step]]
        assert real is not None
        last_step = world_size * len(per_rank[0][-1])
        assert seen[: len(seen) - last_step + real] == list(range(n)), (n, batch_size)


class Numbers(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("even_batches", [True, False])
def test_iterable_data_sets_are_sliced_per_step(even_batches: bool) -> None:
    parts = []
    for rank in range(2):
        shard = IterableDatasetShard(
            Numbers(7),
            batch_size=2,
            rank=rank,
            world_size=2,
            split_batches=False,
            even_batches=even_batches,
            drop_last=False,
        )
        parts.append(list(shard))
        assert shard.last_round_real_samples == 3
    if even_batches:
        assert parts == [[0, 1, 4, 5], [2, 3, 6, 0]]
        assert (
            len(
                IterableDatasetShard(
                    Numbers(7),
                    batch_size=2,
                    rank=0,
                    world_size=2,
                    split_batches=False,
                    even_batches=True,
                    drop_last=False,
                )
            )
            == 4
        )
    else:
        assert parts == [[0, 1, 4, 5], [2, 3, 6]]


def test_the_seedable_sampler_depends_only_on_seed_and_epoch() -> None:
    first = SeedableRandomSampler(range(20), seed=3)
    second = SeedableRandomSampler(range(20), seed=3)
    torch.rand(5)  # other random draws do not change the order
    assert list(first) == list(second)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0 and sorted(first) == list(range(20))


def rank_state(world_size: int = 2, rank: int = 0) -> RankState:
    return RankState(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        device_kind="cpu",
        device=torch.device("cpu"),
    )


def prepare(
    loader: DataLoader, config: DataLoaderConfiguration, world_size: int = 2
) -> DataLoaderShard:  # type: ignore[type-arg]
    return prepare_data_loader(
        loader,
        state=rank_state(world_size),
        config=config,
        gradient_state=GradientState(),
        device_placement=True,
    )


def numbers(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def test_split_batches_with_an_indivisible_batch_size_is_an_error() -> None:
    with pytest.raises(
        ShardingError,
        match=r"split_batches=True cuts each batch of the loader into 2 parts \(one per rank\), but its batch_size is 3; use a batch_size divisible by 2",
    ):
        prepare(DataLoader(numbers(), batch_size=3), DataLoaderConfiguration(split_batches=True))


def test_split_batches_of_an_iterable_with_an_indivisible_batch_size_is_an_error() -> None:
    with pytest.raises(
        ShardingError, match=r"but its batch_size is 5; use a batch_size divisible by 2"
    ):
        prepare(DataLoader(Numbers(10), batch_size=5), DataLoaderConfiguration(split_batches=True))


def test_dispatching_a_loader_without_batch_size_is_an_error() -> None:
    with pytest.raises(
        ShardingError,
        match=r"dispatch_batches=True splits the loader's batches between the ranks, but this DataLoader has batch_size=None",
    ):
        prepare(
            DataLoader(numbers(), batch_size=None), DataLoaderConfiguration(dispatch_batches=True)
        )


def test_a_loader_without_batch_size_cannot_be_sharded() -> None:
    with pytest.raises(
        ShardingError,
        match=r"batch_size=None \(no batching\), so it cannot be split into per-rank batches",
    ):
        prepare(DataLoader(numbers(), batch_size=None), DataLoaderConfiguration())


def test_the_prepared_loader_keeps_the_users_collate_function_and_reports_sizes() -> None:
    def collate(items: list[tuple[torch.Tensor]]) -> list[int]:
        return [int(item[0]) * 100 for item in items]

    loader = prepare(
        DataLoader(numbers(), batch_size=3, collate_fn=collate), DataLoaderConfiguration()
    )
    assert isinstance(loader, DataLoader)
    assert list(loader) == [[0, 100, 200], [600, 700, 800]]
    assert len(loader) == 2 and loader.total_batch_size == 6


def test_a_users_distributed_sampler_is_not_sharded_twice() -> None:
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(numbers(), num_replicas=2, rank=1, shuffle=False)
    loader = prepare(
        DataLoader(numbers(), batch_size=2, sampler=sampler), DataLoaderConfiguration()
    )
    assert [b[0].tolist() for b in loader] == [[1, 3], [5, 7], [9]]


def test_in_one_process_the_prepared_loader_shuffles_exactly_like_the_plain_one() -> None:
    torch.manual_seed(0)
    plain = [b[0].tolist() for b in DataLoader(numbers(), batch_size=4, shuffle=True)]
    after_plain = torch.rand(1)
    torch.manual_seed(0)
    loader = Accelerator().prepare(DataLoader(numbers(), batch_size=4, shuffle=True))
    assert [b[0].tolist() for b in loader] == plain
    assert torch.equal(torch.rand(1), after_plain)  # same random numbers consumed


def test_the_last_batch_is_known_before_it_is_used() -> None:
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(numbers(7), batch_size=3))
    flags = []
    for _ in loader:
        flags.append(loader.end_of_dataloader)
        assert accelerator.gradient_state.active_loader is loader
    assert flags == [False, False, True]
    assert accelerator.gradient_state.active_loader is None


def test_set_epoch_chooses_the_seedable_shuffle() -> None:
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
    )
    loader = accelerator.prepare(DataLoader(numbers(12), batch_size=4, shuffle=True))
    orders = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        orders.append([i for (b,) in loader for i in b.tolist()])
    assert orders[0] == orders[2] != orders[1]
    # Without set_epoch, each full pass moves on to the next epoch: after epoch 0 comes 1.
    assert [i for (b,) in loader for i in b.tolist()] == orders[1]
    assert loader.iteration == 2
