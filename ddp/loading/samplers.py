"""Samplers: shuffled training shards, continued from any sample of an epoch at any world size, optionally
in batches of images of one aspect ratio, and exact unpadded shards for evaluation. Pure functions of
(size, world_size, rank), no process group."""

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler


def shard_indices(size: int, world_size: int, rank: int) -> range:
    """This rank's share of `size` samples, every sample on exactly one rank and none repeated.

    DistributedSampler pads by repeating samples so that all ranks get equal shares; fine for
    training, wrong for metrics. Here shares differ by at most one sample instead.
    """
    return range(rank, size, world_size)


def samples_in_shards(size: int, world_size: int, batch_size: int, limit_batches: int) -> int:
    """The samples of every rank's shard, each cut at `limit_batches` batches (-1: none): how many exact evaluation evaluates."""
    shards = [len(shard_indices(size, world_size, rank)) for rank in range(world_size)]
    return sum(shard if limit_batches == -1 else min(shard, limit_batches * batch_size) for shard in shards)


def most_shard_batches(size: int, world_size: int, batch_size: int, limit_batches: int) -> int:
    """The most batches of any rank's shard of `size` samples (the most forwards a rank runs in exact evaluation):
    rank 0's, its shard being the largest, cut at `limit_batches` (-1: none); at least 1, as many as an
    empty shard's one zero batch. A pure function of the sizes, so every rank computes the same."""
    batches = math.ceil(len(shard_indices(size, world_size, 0)) / batch_size)
    return batches if limit_batches == -1 else min(batches, limit_batches)


class ShardSampler(Sampler[int]):
    """Sequential sampler over `shard_indices`, for exact evaluation."""

    def __init__(self, size: int, world_size: int, rank: int):
        self.indices = shard_indices(size, world_size, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def epoch_order(size: int, seed: int, epoch: int, shard_sizes: Sequence[int] | None = None, window: int = 0) -> list[int]:
    """The epoch's shuffled order of all samples, the same for every world size and worker count.

    window=0: DistributedSampler's own shuffle (a randperm seeded by seed + epoch), before it pads and
    deals it out to the ranks: the most random order, reading anywhere in the dataset at any time.
    window=K, for samples stored in shards (`shard_sizes`: samples per shard, in index order): the
    windows of `epoch_windows` one after the other.
    """
    if not window or shard_sizes is None:
        sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)
    return [index for _, samples in epoch_windows(seed, epoch, shard_sizes, window) for index in samples]


def epoch_windows(seed: int, epoch: int, shard_sizes: Sequence[int], window: int) -> list[tuple[list[int], list[int]]]:
    """(shards, their samples shuffled together) for each window of the epoch: the shards in a shuffled
    order, `window` at a time. Every rank takes every world_size-th sample of the windows' samples, so
    all ranks read within the same K shards (and the next K near a boundary), at the cost of
    randomness: a batch mixes samples of K shards only. Larger K, more random."""
    generator = torch.Generator().manual_seed(seed + epoch)
    starts = [0, *itertools.accumulate(shard_sizes)][:-1]
    shards = torch.randperm(len(shard_sizes), generator=generator).tolist()
    windows = []
    for first in range(0, len(shards), window):
        group = shards[first:first + window]
        indices = [index for shard in group for index in range(starts[shard], starts[shard] + shard_sizes[shard])]
        windows.append((group, [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]))
    return windows


def group_by_aspect_ratio(aspect_ratios: Sequence[float], k: int) -> list[int]:
    """Each image's group (`aspect_ratios`: width / height, one per image), as torchvision's detection
    reference quantises them (create_aspect_ratio_groups, its factor k >= 1): 2k+1 bin edges evenly spaced on a
    log scale from 1/2 to 2, so 2k+2 groups, the outer two for images wider than 2:1 or taller than 1:2.
    A batch of one group pads its images to a common size with little waste."""
    edges = (2 ** np.linspace(-1, 1, 2 * k + 1)).tolist()  # torchvision's arithmetic, so its groups to the bit
    return [bisect.bisect_right(edges, ratio) for ratio in aspect_ratios]


def grouped_order(order: Sequence[int], group_ids: Sequence[int], global_batch: int) -> list[int]:
    """`order` rearranged into global batches of one group each: walking `order`, each sample joins its
    group's buffer, and a buffer that reaches `global_batch` samples is the next global batch. At the
    end, the buffers' leftovers (fewer than `global_batch` per group), in the order of their first
    samples, so every sample is in the result once.

    Why global batches, not each rank's own (torchvision's GroupedBatchSampler on each shard): the order
    is then a function of `order` and `global_batch` only, so 2 ranks x B and 1 rank x 2B train the same
    images at every update, and `rest_of_epoch` dealing out each global batch gives every rank a batch
    of one group, except in the epoch's last few batches (the leftovers). The cost: a rare group's
    images wait until it fills a batch, so they come later in the epoch than the plain shuffle had them.
    """
    buffers: dict[int, list[int]] = {}  # a group's buffer is (re)inserted with its first sample
    grouped = []
    for index in order:
        group = group_ids[index]
        buffers.setdefault(group, []).append(index)
        if len(buffers[group]) == global_batch:
            grouped += buffers.pop(group)
    return grouped + [index for buffer in buffers.values() for index in buffer]


def rest_of_epoch(order: Sequence[int], start: int, world_size: int, rank: int) -> list[int]:
    """This rank's share of `order[start:]`, dealt out as DistributedSampler deals (rank r takes every
    world_size-th sample from r), and padded as it pads: with the epoch's first samples, fewer than
    world_size of them, so that the shares are equal.

    Why it is exact: after k batches of B on each of W ranks, DistributedSampler's ranks have trained
    precisely `order[:k * B * W]`, or all of `order` once k includes the epoch's last batch (which
    may be partial). So a run resumed at any world size continues with `order[start:]`,
    start = min(k * B * W, len(order)), and trains every sample of the epoch once. At the same world
    size, start is a multiple of it, and the shares are the rest of DistributedSampler's own, padding included.
    """
    rest = list(order[start:])
    padding = -len(rest) % world_size
    rest += (list(order) * math.ceil(padding / max(len(order), 1)))[:padding]
    return rest[rank::world_size]


def resume_point(samples_in_epoch: int, batch_size: int, world_size: int) -> tuple[int, int]:
    """(the epoch's first sample of its batch grid, the batches of that grid trained) to continue an
    epoch that has trained `samples_in_epoch` samples of its global order, at this world size.

    The grid starts at 0, unless the world size changed and its global batch doesn't divide the
    position: then it starts at the remainder, the resume landing inside a batch of the old grid. Either
    way the loader starts at the position itself (`start_epoch`), loading nothing before it.
    """
    batches, start = divmod(samples_in_epoch, batch_size * world_size)
    return start, batches


class TrainSampler(DistributedSampler):
    """DistributedSampler(shuffle=True) whose epoch can begin `start` samples into the global order
    (`rest_of_epoch`), set with `set_epoch`, and whose order can go through a sharded dataset's shards
    `window` at a time (`epoch_windows`), or in global batches of one image group each (`group_ids`, one
    per sample; `global_batch`: batch_size x world_size; `grouped_order`; not with a window). With start=0,
    window=0 and no groups it is DistributedSampler exactly.

    `prefetch(shard_numbers)`, where the dataset can fetch shards ahead (remote shards): called as this
    rank's samples enter each window, with the next window's shards (and, first, the current one's too),
    so that they download while the current window trains; the last window's call names the next
    epoch's first window, so that the next epoch doesn't start by waiting for it."""

    start = 0

    def __init__(self, dataset, *, shard_sizes: Sequence[int] | None = None, window: int = 0,
                 prefetch: Callable[[list[int]], None] | None = None, group_ids: Sequence[int] | None = None,
                 global_batch: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.shard_sizes, self.window, self.prefetch = shard_sizes, window, prefetch
        self.group_ids, self.global_batch = group_ids, global_batch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        if self.start == 0 and not self.window and self.group_ids is None:
            return super().__iter__()
        if not self.window or self.shard_sizes is None or self.prefetch is None:
            return iter(self.indices())
        windows = epoch_windows(self.seed, self.epoch, self.shard_sizes, self.window)
        order = [index for _, samples in windows for index in samples]
        return self._prefetching(rest_of_epoch(order, self.start, self.num_replicas, self.rank), windows)

    def indices(self) -> list[int]:
        """This rank's samples of the epoch, in order, as iterating yields them (without prefetching)."""
        if self.start == 0 and not self.window and self.group_ids is None:
            return list(super().__iter__())
        order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shard_sizes, self.window)
        if self.group_ids is not None:
            order = grouped_order(order, self.group_ids, self.global_batch)
        return rest_of_epoch(order, self.start, self.num_replicas, self.rank)

    def _prefetching(self, share: list[int], windows: list[tuple[list[int], list[int]]]) -> Iterator[int]:
        ends = list(itertools.accumulate(len(samples) for _, samples in windows))
        current = None
        for position, index in enumerate(share):
            # the sample's place in the epoch's order (the padding, past its end, reads the first window again)
            place = min(self.start + position * self.num_replicas + self.rank, ends[-1] - 1)
            window = bisect.bisect_right(ends, place)
            if window != current:
                ahead = windows[window + 1:window + 2] if current is not None else windows[window:window + 2]
                if window == len(windows) - 1:
                    ahead = ahead + epoch_windows(self.seed, self.epoch + 1, self.shard_sizes, self.window)[:1]
                self.prefetch([shard for shards, _ in ahead for shard in shards])
                current = window
            yield index

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) - self.start) / self.num_replicas)
