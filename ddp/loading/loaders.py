"""DataLoaders: shuffled shards for training, exact unpadded shards for evaluation; epochs seeded per
(rank, epoch) and iterated from a resume point."""

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ddp.distributed.env import DistEnv
from ddp.loading.loader_workers import WorkerSafeDataLoader
from ddp.loading.samplers import ShardSampler, TrainSampler


def build_train_loader(dataset: Dataset, data_cfg, env: DistEnv, seed: int, pin_memory: bool) -> DataLoader:
    """Every strategy shards with DistributedSampler (one replica for single/dp), so the order of
    samples depends only on the seed, never on the world size. Call `start_epoch` every epoch.

    Workers are not persistent: persistent workers carry their random streams across epochs,
    which a run resumed in a later epoch could not reproduce.
    """
    sampler = TrainSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed)
    return WorkerSafeDataLoader(
        dataset,
        batch_size=data_cfg.batch_size,
        sampler=sampler,
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        collate_fn=getattr(dataset, "collate_fn", None),  # None: torch's default_collate (data/__init__.py)
        # Its own generator, so the loader never draws from the global RNG (see docs/fault-tolerance.md).
        generator=torch.Generator(),
    )


def build_val_loader(dataset: Dataset, data_cfg, env: DistEnv, pin_memory: bool) -> DataLoader:
    return WorkerSafeDataLoader(
        dataset,
        batch_size=getattr(data_cfg, "val_batch_size", None) or data_cfg.batch_size,  # data=voc: 1 (ddp/config/schema.py)
        sampler=ShardSampler(len(dataset), env.world_size, env.rank),
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        collate_fn=getattr(dataset, "collate_fn", None),
        persistent_workers=data_cfg.num_workers > 0,
        generator=torch.Generator(),
    )


def start_epoch(loader: DataLoader, epoch: int, seed: int, rank: int, start: int = 0) -> None:
    """New shuffle order for the epoch (from its `start`-th sample: `resume_point`), and a loader
    generator reseeded per (rank, epoch) so that worker seeds and random augmentation don't depend on
    how many batches came before."""
    loader.sampler.set_epoch(epoch, start)
    loader.generator.manual_seed(seed + 1_000_003 * epoch + rank)


def iterate_from(loader: DataLoader, start_batch: int, stop_batch: int | None = None,
                 on_resume: Callable[[], None] | None = None) -> Iterator:
    """(batch_index, batch) pairs from `start_batch` up to `stop_batch` (the loader's end by default),
    for resuming mid-epoch.

    The skipped batches are loaded and dropped rather than cut from the sampler, so workers'
    random augmentations stay in step with the uninterrupted run. `on_resume` runs just before
    the first yielded batch is loaded (that is when to restore the RNG state). Nothing past
    `stop_batch` is loaded: without workers, loading draws augmentation from the global RNG, which
    a checkpoint saved after the epoch's last batch must not have seen.
    """
    batches = iter(loader)
    for _ in range(start_batch):
        next(batches)
    if on_resume is not None:
        on_resume()
    for batch_index in range(start_batch, len(loader) if stop_batch is None else stop_batch):
        yield batch_index, next(batches)
