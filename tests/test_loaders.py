"""Sampling: every sample seen once per epoch in training, exactly once in evaluation, and fresh orders per epoch."""

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddp.env import DistEnv
from ddp.loaders import build_train_loader, build_val_loader, shard_indices, start_epoch


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
