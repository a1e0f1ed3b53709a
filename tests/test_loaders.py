"""Sampling: every sample seen once per epoch in training, exactly once in evaluation, and fresh orders per epoch."""

from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddp.env import DistEnv
from ddp.loaders import (
    build_train_loader,
    build_val_loader,
    epoch_order,
    iterate_from,
    rest_of_epoch,
    resume_point,
    shard_indices,
    start_epoch,
)


class LoaderConfig:
    batch_size = 4
    num_workers = 0


def ids_dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size))


def epoch_ids(size: int, world_size: int, epoch: int) -> list[list[int]]:
    """The sample ids each rank's train loader yields in `epoch`."""
    per_rank = []
    for rank in range(world_size):
        loader = build_train_loader(ids_dataset(size), LoaderConfig, DistEnv(rank=rank, world_size=world_size), 0, False)
        start_epoch(loader, epoch, seed=0, rank=rank)
        per_rank.append([int(i) for (batch,) in loader for i in batch])
    return per_rank


@pytest.mark.parametrize("size", [1, 2, 10, 11, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_exactly_once(size, world_size):
    shards = [list(shard_indices(size, world_size, rank)) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_distributed_sampler_would_count_samples_twice():
    """Why eval doesn't use DistributedSampler: 10 samples on 4 ranks repeat samples 0 and 1."""
    padded = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert sum(map(len, padded)) == 12


def test_val_loader_yields_each_sample_once_across_ranks():
    ids = []
    for rank in range(3):
        loader = build_val_loader(ids_dataset(11), LoaderConfig, DistEnv(rank=rank, world_size=3), False)
        ids += [int(i) for (batch,) in loader for i in batch]
    assert sorted(ids) == list(range(11))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_train_epoch_visits_every_sample_once(world_size):
    per_rank = epoch_ids(64, world_size, epoch=0)
    assert sorted(i for ids in per_rank for i in ids) == list(range(64))


def test_epochs_differ_and_repeat_for_the_same_seed():
    first, second = epoch_ids(64, 2, epoch=0), epoch_ids(64, 2, epoch=1)
    assert first != second
    assert epoch_ids(64, 2, epoch=1) == second


def test_global_order_does_not_depend_on_world_size():
    """Step k of 2 ranks x batch 4 sees the same samples as step k of 1 process x batch 8."""
    two = epoch_ids(64, 2, epoch=3)
    one = epoch_ids(64, 1, epoch=3)[0]
    for step in range(8):
        joint = sorted(two[0][4 * step : 4 * step + 4] + two[1][4 * step : 4 * step + 4])
        assert joint == sorted(one[8 * step : 8 * step + 8])


def test_epoch_order_is_what_distributed_sampler_deals_out():
    """rest_of_epoch from sample 0 is DistributedSampler itself, padding included (11 samples, 4 ranks)."""
    order = epoch_order(11, seed=0, epoch=2)
    assert sorted(order) == list(range(11))
    for rank in range(4):
        sampler = DistributedSampler(range(11), num_replicas=4, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(2)
        assert rest_of_epoch(order, 0, 4, rank) == list(sampler)


def trained(size: int, world_size: int, batches: int | None = None, samples_in_epoch: int = 0) -> list[list[int]]:
    """The ids each rank's real train loader yields in epoch 1: the first `batches` batches of a fresh
    epoch, or all the rest of one resumed after `samples_in_epoch` samples (as train.py resumes it)."""
    start, skip = resume_point(samples_in_epoch, LoaderConfig.batch_size, world_size)
    per_rank = []
    for rank in range(world_size):
        loader = build_train_loader(ids_dataset(size), LoaderConfig, DistEnv(rank=rank, world_size=world_size), 0, False)
        start_epoch(loader, 1, seed=0, rank=rank, start=start)
        got = [(index, [int(i) for i in batch]) for index, (batch,) in iterate_from(loader, skip)]
        assert [index for index, _ in got] == list(range(skip, len(loader)))  # the loop's batch indices
        per_rank.append([i for index, ids in got if batches is None or index < batches for i in ids])
    return per_rank


@pytest.mark.parametrize("size, world_size, batches, new_world_size", [
    (64, 2, 3, 1),    # scale-down, the global batch divides the position: a plain skip
    (64, 4, 1, 3),    # 16 samples at 3 ranks x batch 4: the new epoch starts 4 samples in
    (50, 3, 2, 2),    # padding at both world sizes
    (101, 2, 5, 4),   # scale-up
    (30, 4, 1, 1),    # 4 ranks padded 30 to 32; 16 trained, 14 left for one process
])
def test_resume_at_another_world_size_trains_each_sample_once(size, world_size, batches, new_world_size):
    """`batches` batches of 4 on each of `world_size` ranks, then the rest of the epoch on
    `new_world_size` ranks: together every sample once, plus the padding that equal shares need at
    the new world size (fewer than new_world_size repeats, as DistributedSampler pads any epoch)."""
    before = trained(size, world_size, batches)
    consumed = batches * LoaderConfig.batch_size * world_size
    after = trained(size, new_world_size, samples_in_epoch=consumed)
    assert len({len(ids) for ids in after}) == 1  # equal shares: DDP ranks run the same number of steps
    counts = Counter(i for ids in before + after for i in ids)
    assert sorted(counts) == list(range(size))
    padding = -(size - consumed) % new_world_size
    assert sum(counts.values()) - size == padding


def test_resume_at_the_same_world_size_skips_whole_batches():
    """At an unchanged world size the epoch starts at sample 0 and the trained batches are loaded and
    dropped (bit-identical resume), whatever the position."""
    assert resume_point(5 * 4 * 2, batch_size=4, world_size=2) == (0, 5)
    assert resume_point(5 * 4 * 2, batch_size=4, world_size=3) == (4, 3)
