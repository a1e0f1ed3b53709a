"""DataLoaders: shuffled shards for training, exact unpadded shards for evaluation, every sample's
random draws seeded per (seed, epoch, sample) (ddp/loading/sample_seeds.py); an epoch iterated from
a resume point without loading what comes before it."""

import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ddp.distributed.env import DistEnv
from ddp.loading.collate import collate
from ddp.loading.loader_workers import WorkerSafeDataLoader
from ddp.loading.sample_seeds import SeededSamples
from ddp.loading.samplers import ShardSampler, TrainSampler, group_by_aspect_ratio


def build_train_loader(dataset: Dataset, data_cfg, env: DistEnv, seed: int, pin_memory: bool) -> DataLoader:
    """Every strategy shards with DistributedSampler (one replica for single/dp), so the order of
    samples depends only on the seed, never on the world size, and so do their random draws
    (SeededSamples). Call `start_epoch` every epoch.

    data.aspect_ratio_groups=K: batches of images of one aspect ratio group, formed on the global batch
    (TrainSampler's group_ids), so that they too are the same at any world size of that global batch.

    Workers are not persistent: each epoch's workers get the dataset with that epoch set.
    """
    samples = SeededSamples(dataset, seed)
    groups = getattr(data_cfg, "aspect_ratio_groups", 0)  # build_datasets has checked the dataset's aspect_ratios
    sampler = TrainSampler(samples, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed,
                           shard_sizes=getattr(dataset, "shard_sizes", None), window=getattr(data_cfg, "shuffle_window", 0),
                           prefetch=getattr(dataset, "prefetch", None),
                           group_ids=group_by_aspect_ratio(dataset.aspect_ratios, groups) if groups else None,
                           global_batch=data_cfg.batch_size * env.world_size)
    return WorkerSafeDataLoader(
        samples,
        batch_size=data_cfg.batch_size,
        sampler=sampler,
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        collate_fn=samples.collate_fn or collate,  # a dataset's own (data/__init__.py), else torch's default_collate's batches
        # Its own generator, so that starting workers never draws from the global RNG (see docs/fault-tolerance.md).
        generator=torch.Generator(),
    )


def build_val_loader(dataset: Dataset, data_cfg, env: DistEnv, pin_memory: bool) -> DataLoader:
    """Exact shards; should a split's loading draw random numbers, the same draws at every validation,
    rank, world size and run seed."""
    samples = SeededSamples(dataset, seed=0)
    return WorkerSafeDataLoader(
        samples,
        batch_size=getattr(data_cfg, "val_batch_size", None) or data_cfg.batch_size,  # data=voc: 1 (ddp/config/schema.py)
        sampler=ShardSampler(len(samples), env.world_size, env.rank),
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        collate_fn=samples.collate_fn or collate,
        persistent_workers=data_cfg.num_workers > 0,
        generator=torch.Generator(),
    )


def start_epoch(loader: DataLoader, epoch: int, start: int = 0) -> None:
    """The epoch's shuffle order from its `start`-th sample (`resume_point`), and its samples' seeds."""
    loader.sampler.set_epoch(epoch, start)
    loader.dataset.epoch = epoch


def iterate_from(loader: DataLoader, start_batch: int, stop_batch: int | None = None,
                 on_resume: Callable[[], None] | None = None) -> Iterator:
    """(batch_index, batch) pairs of an epoch whose loader starts at its `start_batch`-th batch
    (`start_epoch`'s start), numbered from there, up to `stop_batch` (the epoch's end by default).
    Nothing before the start is loaded: a sample's draws don't depend on what was loaded before it.
    `on_resume` runs just before the first batch is loaded (when to restore the RNG state); nothing
    past `stop_batch` is loaded. Batches come as the loader gives them: images that the workers
    handed over as uint8 are normalized on the device by the training step (UpdateStep).
    """
    stop = start_batch + len(loader) if stop_batch is None else stop_batch
    if on_resume is not None:
        on_resume()
    yield from zip(range(start_batch, stop), itertools.islice(loader, max(stop - start_batch, 0)))
