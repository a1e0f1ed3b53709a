"""Samplers: shuffled training shards, continued from any sample of an epoch at any world size, and
exact unpadded shards for evaluation. Pure functions of (size, world_size, rank), no process group."""

import math
from collections.abc import Iterator, Sequence

from torch.utils.data import DistributedSampler, Sampler


def shard_indices(size: int, world_size: int, rank: int) -> range:
    """This rank's share of `size` samples, every sample on exactly one rank and none repeated.

    DistributedSampler pads by repeating samples so that all ranks get equal shares; fine for
    training, wrong for metrics. Here shares differ by at most one sample instead.
    """
    return range(rank, size, world_size)


class ShardSampler(Sampler[int]):
    """Sequential sampler over `shard_indices`, for exact evaluation."""

    def __init__(self, size: int, world_size: int, rank: int):
        self.indices = shard_indices(size, world_size, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shuffled order of all samples, the same for every world size: DistributedSampler's
    own shuffle (a randperm seeded by seed + epoch), before it pads and deals it out to the ranks."""
    sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def rest_of_epoch(order: Sequence[int], start: int, world_size: int, rank: int) -> list[int]:
    """This rank's share of `order[start:]`, dealt out and padded as DistributedSampler does (rank r
    takes every world_size-th sample from r; fewer than world_size repeats make the shares equal).

    Why it is exact: after k batches of B on each of W ranks, DistributedSampler's ranks have trained
    precisely `order[:k * B * W]`, or all of `order` once k includes the epoch's last batch (which
    may be partial). So a run resumed at any world size continues with `order[start:]`,
    start = min(k * B * W, len(order)), and trains every sample of the epoch once.
    """
    rest = order[start:]
    share = DistributedSampler(range(len(rest)), num_replicas=world_size, rank=rank, shuffle=False)
    return [rest[i] for i in share]


def resume_point(samples_in_epoch: int, batch_size: int, world_size: int) -> tuple[int, int]:
    """(first sample of the loader's epoch, batches of it to skip) to continue an epoch that has
    trained `samples_in_epoch` samples of its global order, at this world size.

    The loader starts at the largest multiple of batch_size x world_size it can, and skips the rest
    by loading batches: at an unchanged world size it starts at 0 and skips everything, which keeps a
    resume bit-identical (`iterate_from`). Only a world size whose global batch doesn't divide the
    position starts the epoch part-way (TrainSampler); so does a finished epoch whose last batch
    was partial, with nothing left to load.
    """
    skip, start = divmod(samples_in_epoch, batch_size * world_size)
    return start, skip


class TrainSampler(DistributedSampler):
    """DistributedSampler(shuffle=True) whose epoch can begin `start` samples into the global order
    (`rest_of_epoch`); set both with `set_epoch`. With start=0 it is DistributedSampler exactly."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        if self.start == 0:
            return super().__iter__()
        order = epoch_order(len(self.dataset), self.seed, self.epoch)
        return iter(rest_of_epoch(order, self.start, self.num_replicas, self.rank))

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.start) / self.num_replicas)
