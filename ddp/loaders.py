"""Samplers and DataLoaders: shuffled shards for training, exact unpadded shards for evaluation."""

import contextlib
import functools
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import select
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ddp.env import DistEnv


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


# Workers are forked by a fork server, a single-threaded process that the rank starts once, never by
# the rank itself. A rank runs threads (gloo's, TensorBoard's writer), and a fork copies any lock
# that one of them holds at that moment: forked from the rank, a validation worker hung inside
# os.fork about once in 20 two-rank runs under load, right after a collective, and its rank waited
# for it forever.
#
# torchrun stops a rank with a signal to the rank's whole process group (SIGTERM, or SIGINT when it
# got a Ctrl-C), and a terminal sends Ctrl-C to its whole foreground group. A loader worker that died
# of it would fail the rank before it saves its checkpoint. So the server starts with both signals
# blocked and keeps them so; workers, forked with them blocked, leave the group, drop any that reached
# them before that, and only then take signals again. A worker's parent is the server, which lives as
# long as any worker does, so a worker watches the rank itself and exits when it is gone.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_POSIX = hasattr(signal, "pthread_sigmask")
_FORK_SERVER = "forkserver" in multiprocessing.get_all_start_methods()


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    if not _POSIX:
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # a signal meanwhile is delivered now


def start_worker_server(dataset: Dataset, num_workers: int):
    """Start the fork server (once; call early, so that its imports overlap the rank's set-up) and
    return its context, or None without workers.

    A worker imports the main script, as multiprocessing does. The server imports torch, the main
    script as a module (multiprocessing means to, by default, but Python 3.11 never passes it the
    script's path) and the dataset's module, so that a worker starts in milliseconds, not seconds.
    """
    if num_workers == 0 or not _FORK_SERVER:
        return None
    context = multiprocessing.get_context("forkserver")
    main_script = getattr(sys.modules["__main__"], "__file__", None)
    context.set_forkserver_preload(["torch", type(dataset).__module__, *([Path(main_script).stem] if main_script else [])])
    multiprocessing.resource_tracker.ensure_running()  # first: starting it unblocks the stop signals
    with _stop_signals_blocked():
        multiprocessing.forkserver.ensure_running()
    return context


def _init_worker(worker_id: int, rank_pid: int) -> None:
    if not _POSIX:
        return
    os.setpgid(0, 0)
    while signal.sigtimedwait(_STOP_SIGNALS, 0) is not None:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if hasattr(os, "pidfd_open"):
        threading.Thread(target=_exit_with, args=(rank_pid,), daemon=True).start()


def _exit_with(rank_pid: int) -> None:
    try:
        rank = os.pidfd_open(rank_pid)
    except ProcessLookupError:
        os._exit(0)
    select.select([rank], [], [])  # readable once the rank has exited
    os._exit(0)


class WorkerSafeDataLoader(DataLoader):
    """A DataLoader whose workers come from the fork server, outlive a SIGTERM or SIGINT to the
    rank's process group, and end with the rank (see above)."""

    def __init__(self, dataset: Dataset, num_workers: int, **kwargs):
        super().__init__(dataset, num_workers=num_workers, multiprocessing_context=start_worker_server(dataset, num_workers),
                         worker_init_fn=functools.partial(_init_worker, rank_pid=os.getpid()), **kwargs)

    def __iter__(self):
        with _stop_signals_blocked():  # workers start inside, inheriting the blocked signals
            iterator = super().__iter__()
        if self.num_workers > 0:
            _iterators_with_workers.add(iterator)
        return iterator


# Every iterator of a WorkerSafeDataLoader in this process that started workers (see shut_down_workers).
_iterators_with_workers: "weakref.WeakSet" = weakref.WeakSet()


def shut_down_workers() -> None:
    """Shut down the workers of every loader iterator still alive in this process and wait for them,
    through torch's own shutdown (the one an exhausted or collected iterator runs). For a rank about
    to exit with its loader still referenced, as a stop's exception holds the loop's frames.

    Left to the interpreter's exit, torch skips its shutdown, and multiprocessing unlinks the queues'
    named semaphores and only then terminates the workers. A worker still starting (under load, seconds
    after the first batch; it blocks the stop signals until it has started) then fails to open its
    queues and prints a FileNotFoundError traceback under the stop's message. Shut down here instead,
    a starting worker finishes starting, finds the shutdown and exits."""
    for iterator in list(_iterators_with_workers):
        iterator._shutdown_workers()


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
        batch_size=getattr(data_cfg, "val_batch_size", None) or data_cfg.batch_size,  # data=voc: 1 (ddp/config.py)
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
