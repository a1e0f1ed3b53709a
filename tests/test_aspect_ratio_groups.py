"""data.aspect_ratio_groups: batches of one aspect ratio group, formed on the global batch, so that every
image trains once per epoch, 2 ranks x B train what 1 process x 2B trains, and a resume continues the
epoch exactly. Pure functions and the real sampler and loader, no process group."""

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import DistributedSampler, TensorDataset

from data import build_datasets
from ddp.checkpoints.resume import check_sample_order_fits
from ddp.config.checks import validate
from ddp.config.schema import ConfigError, register_configs
from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_train_loader, iterate_from, start_epoch
from ddp.loading.samplers import TrainSampler, epoch_order, group_by_aspect_ratio, grouped_order, resume_point

REPO = Path(__file__).resolve().parents[1]
SEED = 0


class RatioDataset(TensorDataset):
    """Sample i is its id i, and `aspect_ratios`, as a detection dataset exposes them: from 1:4 to 4:1."""

    def __init__(self, size: int, data_seed: int = 0):
        super().__init__(torch.arange(size))
        generator = torch.Generator().manual_seed(data_seed)
        self.aspect_ratios = (2 ** (torch.rand(size, generator=generator) * 4 - 2)).tolist()


def loader_config(batch_size: int, groups: int):
    return OmegaConf.create({"batch_size": batch_size, "num_workers": 0, "aspect_ratio_groups": groups})


def loader_batches(dataset: RatioDataset, world_size: int, batch_size: int, groups: int, epoch: int,
                   samples_in_epoch: int = 0) -> list[list[list[int]]]:
    """Each rank's batches of sample ids from the real train loader, resumed after `samples_in_epoch` as train.py resumes."""
    _, first_batch = resume_point(samples_in_epoch, batch_size, world_size)
    per_rank = []
    for rank in range(world_size):
        env = DistEnv(rank=rank, world_size=world_size)
        loader = build_train_loader(dataset, loader_config(batch_size, groups), env, SEED, False)
        start_epoch(loader, epoch, samples_in_epoch)
        per_rank.append([[int(i) for i in batch] for _, (batch,) in iterate_from(loader, first_batch)])
    return per_rank


def updates(per_rank: list[list[list[int]]], size: int) -> list[list[int]]:
    """Each update's images on all ranks together (`per_rank`: loader_batches' to the epoch's end), sorted, without
    the padding of equal shares: DistributedSampler's, the last sample of the last -size % world_size ranks."""
    batches = [[list(batch) for batch in rank_batches] for rank_batches in per_rank]
    for rank in range(len(batches) - -size % len(batches), len(batches)):
        batches[rank][-1].pop()
    return [sorted(i for rank_batches in batches for i in rank_batches[k]) for k in range(len(batches[0]))]


def sampler(size: int, group_ids: list[int] | None, world_size: int, rank: int, batch_size: int) -> TrainSampler:
    return TrainSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, group_ids=group_ids,
                        global_batch=batch_size * world_size)


def full_batches(group_ids: list[int], global_batch: int) -> int:
    """The global batches of one group each in an epoch: every group fills one per `global_batch` of its images."""
    return sum(count // global_batch for count in Counter(group_ids).values())


def test_groups_are_torchvisions():
    """k=1: bin edges 1/2, 1, 2 (bisect_right: a ratio on an edge goes above it); k=3: 8 groups."""
    assert group_by_aspect_ratio([0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0], 1) == [0, 1, 1, 2, 2, 3, 3]
    assert group_by_aspect_ratio([0.1, 0.6, 4 / 3, 1.0, 10.0], 3) == [0, 1, 5, 4, 7]


@pytest.mark.parametrize("size, groups, batch_size, world_size", [
    (100, 1, 4, 2), (101, 3, 4, 2), (64, 3, 8, 1), (37, 2, 3, 3), (7, 3, 2, 4), (250, 8, 5, 4),
])
def test_every_image_once_per_epoch(size, groups, batch_size, world_size):
    """All ranks' shares together: each image once, plus the fewer than world_size that pad equal shares, as
    DistributedSampler pads; each share as long as len(sampler) says, the length without groups."""
    group_ids = group_by_aspect_ratio(RatioDataset(size).aspect_ratios, groups)
    for epoch in range(3):
        shares = []
        for rank in range(world_size):
            grouped = sampler(size, group_ids, world_size, rank, batch_size)
            grouped.set_epoch(epoch)
            shares.append(list(grouped))
            assert len(shares[-1]) == len(grouped)
        counts = Counter(i for share in shares for i in share)
        assert sorted(counts) == list(range(size))
        assert sum(counts.values()) - size == -size % world_size


@pytest.mark.parametrize("size, batch_size", [(96, 4), (101, 4), (50, 3)])
def test_2_ranks_x_b_train_what_1_process_x_2b_trains(size, batch_size):
    """The real loaders: update k of 2 ranks x B holds the same images as update k of 1 process x 2B, in every
    update of 2 epochs, the leftover batches at the end included."""
    dataset = RatioDataset(size)
    for epoch in range(2):
        two = loader_batches(dataset, 2, batch_size, 3, epoch)
        one = loader_batches(dataset, 1, 2 * batch_size, 3, epoch)
        assert updates(two, size) == updates(one, size)


@pytest.mark.parametrize("world_size, batch_size, groups", [(2, 4, 3), (1, 8, 3), (4, 2, 1), (3, 5, 2)])
def test_a_ranks_batch_is_of_one_group_but_the_epochs_leftovers(world_size, batch_size, groups):
    """Every global batch before the leftovers (sum over groups of images // global batch) is of one group on every
    rank; the leftovers are no more global batches than there are groups."""
    dataset = RatioDataset(300, data_seed=1)
    group_ids = group_by_aspect_ratio(dataset.aspect_ratios, groups)
    full = full_batches(group_ids, batch_size * world_size)
    per_rank = loader_batches(dataset, world_size, batch_size, groups, epoch=1)
    for batches in per_rank:
        assert all(len({group_ids[i] for i in batch}) == 1 for batch in batches[:full])
        assert len(batches) - full <= 2 * groups + 2
    assert full >= 0.8 * len(per_rank[0])  # most: 4 to 8 groups of 300 images, global batches of 8 to 15


@pytest.mark.parametrize("size, world_size, batch_size", [(100, 2, 4), (61, 3, 2), (40, 1, 8)])
def test_a_resume_at_a_global_batch_continues_the_epoch_exactly(size, world_size, batch_size):
    """set_epoch(epoch, start) at the start of global batch k: each rank's batches are the rest of its
    uninterrupted epoch's, from batch k on, computed without the batches before it."""
    group_ids = group_by_aspect_ratio(RatioDataset(size).aspect_ratios, 3)
    global_batch = batch_size * world_size
    for rank in range(world_size):
        whole = sampler(size, group_ids, world_size, rank, batch_size)
        whole.set_epoch(4)
        uninterrupted = list(whole)
        for batch in range(math.ceil(size / global_batch)):
            resumed = sampler(size, group_ids, world_size, rank, batch_size)
            resumed.set_epoch(4, batch * global_batch)
            assert list(resumed) == resumed.indices() == uninterrupted[batch * batch_size:]
            assert len(resumed) == len(uninterrupted) - batch * batch_size
        resumed.set_epoch(4, size)  # after the epoch's last batch: nothing left
        assert list(resumed) == []


@pytest.mark.parametrize("size, trained_batches", [(100, 3), (101, 12), (64, 1)])
def test_2_ranks_resumed_as_1_process_of_the_same_global_batch_train_each_image_once(size, trained_batches):
    """2 ranks x 4 stopped after `trained_batches` updates, the epoch finished by 1 process x 8 (the loaders
    as train.py resumes them): every image once, and the resumed updates are those 2 ranks would have trained."""
    dataset = RatioDataset(size)
    before = [batches[:trained_batches] for batches in loader_batches(dataset, 2, 4, 3, epoch=2)]
    after = loader_batches(dataset, 1, 8, 3, epoch=2, samples_in_epoch=trained_batches * 8)[0]
    counts = Counter(i for batches in [*before, after] for batch in batches for i in batch)
    assert sorted(counts) == list(range(size)) and sum(counts.values()) == size
    uninterrupted = updates(loader_batches(dataset, 2, 4, 3, epoch=2), size)
    assert updates([after], size - trained_batches * 8) == uninterrupted[trained_batches:]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_without_groups_the_order_is_distributed_samplers(world_size):
    """data.aspect_ratio_groups=0 on a dataset with aspect_ratios: DistributedSampler's order, bit for bit."""
    dataset = RatioDataset(53)
    for rank in range(world_size):
        loader = build_train_loader(dataset, loader_config(4, 0), DistEnv(rank=rank, world_size=world_size), SEED, False)
        start_epoch(loader, 2)
        plain = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
        plain.set_epoch(2)
        assert loader.sampler.group_ids is None
        assert list(loader.sampler) == loader.sampler.indices() == list(plain)


def test_grouped_order_keeps_full_batches_in_the_order_they_fill():
    """Groups a (ids 0-3) and b (4-7), global batch 2: each batch as soon as its group has 2 in the order, then the
    leftovers, group by group in the order of their first samples."""
    group_ids = [0, 0, 0, 0, 1, 1, 1, 1]
    assert grouped_order([4, 0, 5, 1, 2, 6, 3], group_ids, 2) == [4, 5, 0, 1, 2, 3, 6]
    assert grouped_order([4, 0, 1, 7, 2], group_ids, 4) == [4, 7, 0, 1, 2]  # none fills: b's first, its first came first
    order = epoch_order(30, SEED, 0)
    assert sorted(grouped_order(order, [i % 3 for i in range(30)], 4)) == list(range(30))


def composed(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["data=synthetic", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["data.aspect_ratio_groups=-1"], "data.aspect_ratio_groups=-1: must be >= 0"),
    (["data.aspect_ratio_groups=3", "data.shuffle_window=2"],
     "data.aspect_ratio_groups=3: can't go with data.shuffle_window=2"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(composed(*overrides), launched=False, world_size=1)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_dataset_without_aspect_ratios_is_refused():
    with pytest.raises(ConfigError) as error:
        build_datasets(composed("data.aspect_ratio_groups=3", "data.num_samples=16", "data.num_val_samples=4").data)
    assert str(error.value).startswith("data.aspect_ratio_groups=3: groups images by aspect ratio, but ")
    assert "use data.aspect_ratio_groups=0" in str(error.value)


def checkpoint(groups: int, batch_size: int, world_size: int, samples_in_epoch: int) -> dict:
    return {"config": {"data": {"batch_size": batch_size, "aspect_ratio_groups": groups}}, "world_size": world_size,
            "samples_in_epoch": samples_in_epoch, "batch_in_epoch": samples_in_epoch // (batch_size * world_size)}


@pytest.mark.parametrize("saved, now, refused", [
    ((3, 4, 2, 40), (3, 8, 1), False),   # the world size changes, the global batch stays: the same order
    ((3, 4, 2, 40), (3, 4, 1), True),    # another global batch mid-epoch
    ((3, 4, 2, 40), (0, 4, 2), True),    # grouping turned off mid-epoch
    ((0, 4, 2, 40), (3, 4, 2), True),    # grouping turned on mid-epoch
    ((0, 4, 2, 40), (0, 4, 1), False),   # no grouping: any world size, as before
    ((3, 4, 2, 0), (3, 4, 1), False),    # at an epoch's start
    ((3, 4, 2, 100), (1, 4, 1), False),  # at its end
])
def test_a_resume_mid_epoch_keeps_the_grouped_order(saved, now, refused):
    groups, batch_size, world_size = now
    data_cfg = loader_config(batch_size, groups)
    if not refused:
        check_sample_order_fits(checkpoint(*saved), Path("last.pt"), data_cfg, world_size, train_size=100)
        return
    with pytest.raises(ConfigError) as error:
        check_sample_order_fits(checkpoint(*saved), Path("last.pt"), data_cfg, world_size, train_size=100)
    assert str(error.value).startswith(f"resume: last.pt stopped mid-epoch with data.aspect_ratio_groups={saved[0]}")
