"""Sampling: every sample seen once per epoch in training, exactly once in evaluation, and fresh orders per epoch."""

import itertools
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from ddp.distributed.env import DistEnv
from conftest import write_imagefolder
from ids_and_noise import IdsAndNoise, ImageSegments, LargeViews, PageFaults, segment_of
from ddp.checkpoints.resume import capture_rank_state, checkpoint_state, resume_position
from ddp.loading.loaders import build_train_loader, build_val_loader, iterate_from, start_epoch
from ddp.loading.samplers import TrainSampler, epoch_order, epoch_windows, rest_of_epoch, resume_point, shard_indices
from ddp.training.progress import Position
from ddp.training.update import UpdateStep
from tasks.classification import ClassificationTask
from train import TrainingLength, train_one_epoch


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
        start_epoch(loader, epoch)
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
    _, batches_trained = resume_point(samples_in_epoch, LoaderConfig.batch_size, world_size)
    per_rank = []
    for rank in range(world_size):
        loader = build_train_loader(ids_dataset(size), LoaderConfig, DistEnv(rank=rank, world_size=world_size), 0, False)
        start_epoch(loader, 1, samples_in_epoch)
        got = [(index, [int(i) for i in batch]) for index, (batch,) in iterate_from(loader, batches_trained)]
        assert [index for index, _ in got] == list(range(batches_trained, batches_trained + len(loader)))  # the loop's batch indices
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


def train_epoch_part(size: int, world_size: int, accumulate: int, checkpoint: dict | None,
                     stop_at_step: int | None) -> tuple[list[list[int]], dict, bool]:
    """Every rank of a run at `world_size` trains epoch EPOCH as train.py's `fit` does: from the start,
    or from `checkpoint`'s position (`resume_position`), through the real `train_one_epoch` with a real
    update, until it stops right after update `stop_at_step` (None: never). Returns the sample ids each
    rank trained, the checkpoint its stop (or the epoch's end) saves, and whether the epoch ended."""
    length = TrainingLength.of(SimpleNamespace(limit_train_batches=-1, accumulate_grad_batches=accumulate,
                                               global_batch_size=None, max_epochs=1, max_steps=-1),
                               size, LoaderConfig.batch_size, world_size)
    dataset = TensorDataset(torch.arange(size, dtype=torch.float32).unsqueeze(1), torch.zeros(size, dtype=torch.long))
    trained_ids, ended, rank_states = [], [], []
    for rank in range(world_size):
        if checkpoint is None:
            position = Position(epoch=EPOCH)
        else:
            position, _ = resume_position(Path("last.pt"), checkpoint, LoaderConfig.batch_size, world_size, rank, size)
        ids = []
        model = nn.Linear(1, 2)
        model.register_forward_pre_hook(lambda module, args, ids=ids: ids.extend(args[0][:, 0].long().tolist()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        update = UpdateStep(model, optimizer, task=ClassificationTask(), precision="32")
        loader = build_train_loader(dataset, LoaderConfig, DistEnv(rank=rank, world_size=world_size), 0, False)
        # train's epoch, as it starts one and tells when it has ended
        start_epoch(loader, position.epoch, position.samples_in_epoch(length.samples_per_batch, size))
        epoch_batches = min(position.batch_in_epoch + len(loader), length.batches_per_epoch)
        batches = iterate_from(loader, position.batch_in_epoch, epoch_batches)

        # the stop of a run at an update (a signal's, agreed by the ranks): the loop saves and exits there
        for _ in train_one_epoch(update, batches, epoch_batches, position, length, world_size):
            if position.global_step == stop_at_step:
                break
        trained_ids.append(ids)
        ended.append(position.batch_in_epoch >= epoch_batches)
        rank_states.append(capture_rank_state(position.epoch_totals, []))
    assert len(set(ended)) == 1 and len({len(ids) for ids in trained_ids}) == 1  # the ranks in step
    saved = checkpoint_state(model, optimizer, update.state_dict(), position, position.samples_in_epoch(length.samples_per_batch, size),
                             rank_states, {"data": {"batch_size": LoaderConfig.batch_size}})
    return trained_ids, saved, ended[0]


EPOCH = 1


@pytest.fixture
def one_thread():
    """Updates of a 3-parameter model: a busy machine's second core would only make every op wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("new_world_size", [1, 2, 3])
def test_a_stop_anywhere_resumes_at_any_world_size_and_trains_each_sample_once(world_size, new_world_size):
    """A run at `world_size` stops after each of its updates in turn: mid-epoch, at the epoch's end
    with full batches (24 samples in batches of 4) or a partial last batch (25, 30: also padded shares),
    after a group of 2 micro-batches or after the epoch's last group, cut short. It resumes at
    `new_world_size`, and finishes the epoch there, or stops again after its first update (which,
    resumed inside a group, the resume cuts short) and finishes at each world size. No resume fails,
    and the epoch trains every sample once, plus the repeats DistributedSampler pads equal shares
    with where the epoch ends."""

    def finish(parts: list[tuple[list[list[int]], int, int, bool]]) -> None:
        counts = Counter(i for ids, _, _, _ in parts for rank_ids in ids for i in rank_ids)
        assert sorted(counts) == list(range(size)), parts
        # (ids per rank, world size, samples trained before, epoch ended): the part that ends the
        # epoch trains its padding; a stopped one trains a prefix of the epoch's order, no repeats
        padding = sum(-(size - before) % world for _, world, before, ended in parts if ended)
        assert sum(counts.values()) - size == padding, parts
        assert parts[-1][3], "the epoch did not end"

    for size in (24, 25, 30):
        for accumulate in (1, 2):
            for stop in range(1, 100):
                first, checkpoint, ended = train_epoch_part(size, world_size, accumulate, None, stop)
                if ended and checkpoint["global_step"] < stop:
                    break  # the epoch has fewer updates than `stop`
                parts = [(first, world_size, 0, ended)]
                second = train_epoch_part(size, new_world_size, accumulate, checkpoint, None)
                finish([*parts, (second[0], new_world_size, checkpoint["samples_in_epoch"], second[2])])
                if ended:
                    continue
                second, again, second_ended = train_epoch_part(size, new_world_size, accumulate, checkpoint,
                                                               checkpoint["global_step"] + 1)
                parts.append((second, new_world_size, checkpoint["samples_in_epoch"], second_ended))
                for last_world_size in (1, 2, 3):
                    third = train_epoch_part(size, last_world_size, accumulate, again, None)
                    finish([*parts, (third[0], last_world_size, again["samples_in_epoch"], third[2])])


@pytest.mark.parametrize("stop", [4, 7], ids=["mid_epoch", "epoch_end_partial_batch"])
def test_resume_at_the_same_world_size_loads_the_rest_of_the_epoch_as_the_uninterrupted_run(stop):
    """Rank 1 of 2, 2 workers, 25 samples in 7 batches of 4 (the last of 1). A checkpoint after `stop`
    batches, resumed at the same world size as train.py resumes it (`resume_position`, then the
    epoch's loader from that position), yields the uninterrupted epoch's batches from `stop` on: the
    same indices, ids and random draws. It restores the rank's RNG state too (a resume at another
    world size can't)."""
    world_size, rank, batch_size, size = 2, 1, LoaderConfig.batch_size, len(IdsAndNoise())
    data_cfg = SimpleNamespace(batch_size=batch_size, num_workers=2)

    def epoch_loader(start: int = 0):
        loader = build_train_loader(IdsAndNoise(), data_cfg, DistEnv(rank=rank, world_size=world_size), 0, False)
        start_epoch(loader, EPOCH, start)
        return loader

    full = list(epoch_loader())
    assert len(full) == 7 and len(full[-1][0]) == 1
    model = nn.Linear(1, 1)
    states = [capture_rank_state(torch.tensor([float(r), 1.0], dtype=torch.float64), []) for r in range(world_size)]
    position = Position(epoch=EPOCH, batch_in_epoch=stop, global_step=stop)
    checkpoint = checkpoint_state(model, torch.optim.SGD(model.parameters(), lr=0.1), {}, position,
                                  position.samples_in_epoch(batch_size * world_size, size), states, {"data": {"batch_size": batch_size}})
    position, rank_state = resume_position(Path("last.pt"), checkpoint, batch_size, world_size, rank, size)
    assert rank_state is states[rank] and position.epoch_totals.tolist() == [1.0, 1.0]
    loader = epoch_loader(position.samples_in_epoch(batch_size * world_size, size))
    epoch_batches = min(position.batch_in_epoch + len(loader), len(full))
    resumed = list(iterate_from(loader, position.batch_in_epoch, epoch_batches))
    assert [index for index, _ in resumed] == list(range(stop, len(full)))
    for (index, (ids, noise)) in resumed:
        assert torch.equal(ids, full[index][0]) and torch.equal(noise, full[index][1]), index
    assert position.batch_in_epoch + len(resumed) == epoch_batches  # the loop then ends the epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_samples_random_draws_depend_only_on_the_seed_the_epoch_and_the_sample(num_workers):
    """Each sample's draws from torch's, Python's and numpy's RNGs, as 1, 2 and 3 ranks load the epoch,
    with and without workers: the same at every world size, both epochs differing, every sample its own."""
    def draws(world_size: int, epoch: int, workers: int) -> dict[int, list[float]]:
        found = {}
        for rank in range(world_size):
            env, data_cfg = DistEnv(rank=rank, world_size=world_size), SimpleNamespace(batch_size=4, num_workers=workers)
            loader = build_train_loader(IdsAndNoise(), data_cfg, env, 0, False)
            start_epoch(loader, epoch)
            found |= {int(i): noise.tolist() for ids, noises in loader for i, noise in zip(ids, noises)}
        return found

    one = draws(1, EPOCH, 0)
    assert sorted(one) == list(range(50))
    assert len({tuple(noise) for noise in one.values()}) == 50
    assert draws(2, EPOCH, num_workers) == one and draws(3, EPOCH, num_workers) == one
    next_epoch = draws(2, EPOCH + 1, num_workers)
    assert all(next_epoch[i] != one[i] for i in one)


def test_loading_without_workers_leaves_the_training_steps_rng_as_it_was():
    """With data.num_workers=0 samples load in the training process, whose dropout and MixUp draw from
    torch's global RNG: seeding a sample must not move that stream, or the training step's draws would
    be the last sample's."""
    loader = build_train_loader(IdsAndNoise(), LoaderConfig, DistEnv(), 0, False)
    start_epoch(loader, EPOCH)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert len(list(loader)) == 13
    assert torch.equal(torch.get_rng_state(), before)


# --- data.shuffle_window: shards K at a time ----------------------------------------------------------

SHARD_SIZES = [7, 9, 8, 8, 6, 9, 3]  # 50 samples in 7 shards of uneven sizes, as a converter's last shard is


def shard_of(index: int) -> int:
    return next(shard for shard, end in enumerate(itertools.accumulate(SHARD_SIZES)) if index < end)


def test_a_windowed_order_is_every_sample_once_in_groups_of_window_shards():
    """window=K: the shards in a shuffled order, K at a time, their samples shuffled together; another
    order each epoch, the same for the same epoch; window 0 is the full shuffle."""
    for window in (1, 2, 3):
        order = epoch_order(50, seed=0, epoch=EPOCH, shard_sizes=SHARD_SIZES, window=window)
        assert sorted(order) == list(range(50))
        shards = list(dict.fromkeys(shard_of(index) for index in order))  # in the order the epoch reaches them
        groups = [shards.index(shard_of(index)) // window for index in order]
        assert groups == sorted(groups)  # a group's samples all come before the next group's
        assert order != sorted(order, key=lambda index: (groups[order.index(index)], index))  # shuffled within
        assert order == epoch_order(50, seed=0, epoch=EPOCH, shard_sizes=SHARD_SIZES, window=window)
        assert order != epoch_order(50, seed=0, epoch=EPOCH + 1, shard_sizes=SHARD_SIZES, window=window)
    assert epoch_order(50, 0, EPOCH, SHARD_SIZES, window=0) == epoch_order(50, 0, EPOCH)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_with_a_window_every_rank_reads_within_the_current_shards_and_the_order_ignores_the_world_size(num_workers):
    """data.shuffle_window=2 through the real train loader at 1, 2 and 3 ranks: every sample once per
    epoch; step k of W ranks x B holds the samples of step k of 1 process x W*B (N x B = 1 x NB); and
    at every step the shards all ranks read are within two consecutive groups of 2 (the current one and
    the next, where a batch crosses a boundary)."""
    data_cfg = SimpleNamespace(batch_size=4, num_workers=num_workers, shuffle_window=2)

    def ranks_batches(world_size: int) -> list[list[list[int]]]:
        per_rank = []
        for rank in range(world_size):
            loader = build_train_loader(IdsAndNoise(shard_sizes=SHARD_SIZES), data_cfg, DistEnv(rank=rank, world_size=world_size), 0, False)
            start_epoch(loader, EPOCH)
            per_rank.append([[int(i) for i in ids] for ids, _ in loader])
        return per_rank

    group_of, seen = {}, []  # each sample's group of 2 shards, numbered in the epoch's order
    for index in epoch_order(50, 0, EPOCH, SHARD_SIZES, window=2):
        seen += [shard_of(index)] if shard_of(index) not in seen else []
        group_of[index] = (len(seen) - 1) // 2
    for world_size in (1, 2, 3):
        per_rank = ranks_batches(world_size)
        counts = Counter(i for batches in per_rank for batch in batches for i in batch)
        assert sorted(counts) == list(range(50)) and sum(counts.values()) - 50 == -50 % world_size
        for step in range(len(per_rank[0])):
            # (the epoch's last step may repeat its first samples: the padding that equal shares need)
            read = {group_of[i] for batches in per_rank for i in batches[step] if counts[i] == 1}
            assert max(read) - min(read) <= 1, (world_size, step, read)
            if world_size == 2:
                (one,) = ranks_batches(1) if step == 0 else (one,)
                assert sorted(per_rank[0][step] + per_rank[1][step]) == sorted(sum(one[2 * step:2 * step + 2], [])), step


@pytest.mark.parametrize("start", [0, 46], ids=["from_the_start", "resumed_in_the_last_window"])
def test_each_window_entered_prefetches_the_next_and_the_last_the_next_epochs_first(start):
    """data.shuffle_window=2 on 7 shards, rank 1 of 2: as the rank's samples enter a window, prefetch
    names the next window's shards before the rank reads any sample of the window entered (the first
    call, the current window's too); the last window's call names the next epoch's first window, so a
    new epoch never starts by waiting for its shards. A resume inside the last window does the same."""
    calls, order = [], []
    sampler = TrainSampler(range(50), num_replicas=2, rank=1, seed=0, shard_sizes=SHARD_SIZES, window=2,
                           prefetch=lambda shards: calls.append((len(order), shards)))
    sampler.set_epoch(EPOCH, start)
    order.extend(sampler)  # len(order) when called: how many of the rank's samples came before the call
    windows = [shards for shards, _ in epoch_windows(0, EPOCH, SHARD_SIZES, window=2)]
    next_epochs_first = epoch_windows(0, EPOCH + 1, SHARD_SIZES, window=2)[0][0]
    entered = [next(number for number, shards in enumerate(windows) if shard_of(index) in shards) for index in order]
    firsts = [position for position in range(len(order)) if position == 0 or entered[position] != entered[position - 1]]
    assert [position for position, _ in calls] == firsts
    for (_, shards), position in zip(calls, firsts):
        window = entered[position]
        expected = (windows[window] if position == 0 else []) + sum(windows[window + 1:window + 2], [])
        assert shards == expected + (next_epochs_first if window == len(windows) - 1 else []), (window, shards)
    assert entered[-1] == len(windows) - 1


def test_an_epoch_with_a_window_continued_at_another_world_size_trains_each_sample_once():
    """Stopped after 2 steps of 2 ranks x 4 with data.shuffle_window=2, continued by 3 ranks: the rest of
    the same windowed order, every sample once (plus the padding equal shares need)."""
    data_cfg = SimpleNamespace(batch_size=4, num_workers=0, shuffle_window=2)
    before = []
    for rank in range(2):
        loader = build_train_loader(IdsAndNoise(shard_sizes=SHARD_SIZES), data_cfg, DistEnv(rank=rank, world_size=2), 0, False)
        start_epoch(loader, EPOCH)
        before += [int(i) for _, (ids, _) in zip(range(2), loader) for i in ids]
    after = []
    for rank in range(3):
        loader = build_train_loader(IdsAndNoise(shard_sizes=SHARD_SIZES), data_cfg, DistEnv(rank=rank, world_size=3), 0, False)
        start_epoch(loader, EPOCH, len(before))
        after += [int(i) for ids, _ in loader for i in ids]
    counts = Counter(before + after)
    assert sorted(counts) == list(range(50)) and sum(counts.values()) - 50 == -(50 - 16) % 3


# --- images leave the workers as uint8 ------------------------------------------------------------------

@pytest.mark.parametrize("random_erase", [0.0, 0.5])
def test_worker_batches_of_images_are_uint8_and_normalize_on_the_device_to_the_in_process_bits(tmp_path, random_erase):
    """With workers, a preset's training and validation images cross shared memory as uint8 (a quarter
    of float32's bytes) and to_device normalizes them with the dataset's normalization: the very bits the
    same samples have when loaded in the process, contiguous as those are. The uint8 batch is channels_last:
    the decoded images are stacked as they lie in memory, (H, W, C). With random erasing, which erases
    normalized pixels, training images are normalized in the worker."""
    from data.vision import build_imagefolder
    from ddp.loading.batches import to_device

    root = write_imagefolder(tmp_path / "images", per_class=5, size=(40, 30))
    splits = build_imagefolder(str(root), image_size=16, augment="standard", random_erase=random_erase, interpolation="bilinear")

    def batches(workers: int, split: str) -> list:
        data_cfg = SimpleNamespace(batch_size=4, num_workers=workers)
        if split == "train":
            loader = build_train_loader(splits.train, data_cfg, DistEnv(), 0, False)
            start_epoch(loader, EPOCH)
        else:
            loader = build_val_loader(splits.val, data_cfg, DistEnv(), False)
        return [(images, to_device(images, torch.device("cpu"), normalization=loader.dataset.image_normalization))
                for images, _ in loader]

    for split, travels_as in (("train", torch.float32 if random_erase else torch.uint8), ("val", torch.uint8)):
        in_process, from_workers = batches(0, split), batches(2, split)
        assert {images.dtype for images, _ in in_process} == {torch.float32}
        assert {images.dtype for images, _ in from_workers} == {travels_as}, split
        assert all(images.is_contiguous(memory_format=torch.channels_last) for images, _ in from_workers
                   if images.dtype == torch.uint8), split
        assert len(in_process) == len(from_workers) == 3
        for (_, expected), (_, normalized) in zip(in_process, from_workers):
            assert normalized.dtype == torch.float32 and torch.equal(normalized, expected), split
            assert normalized.is_contiguous() and expected.is_contiguous(), split


def test_the_training_step_normalizes_worker_batches_after_the_data_wait_and_trains_as_in_process(tmp_path):
    """As train.py composes them: the data-wait meter times each batch as the loader hands it over (uint8
    images from workers, nothing moved or normalized yet), and the UpdateStep given the dataset's
    normalization trains on those batches to the very weights of the same epoch loaded in the process."""
    from data.vision import build_imagefolder
    from ddp.loading.batches import BatchPlacement
    from ddp.reporting.meter import ThroughputMeter

    root = write_imagefolder(tmp_path / "images", per_class=5, size=(40, 30))
    train = build_imagefolder(str(root), image_size=16, augment="standard", random_erase=0.0, interpolation="bilinear").train

    def trained(workers: int) -> tuple[set, dict]:
        loader = build_train_loader(train, SimpleNamespace(batch_size=4, num_workers=workers), DistEnv(), 0, False)
        start_epoch(loader, EPOCH)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
        update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task=ClassificationTask(), precision="32",
                            placement=BatchPlacement(normalization=loader.dataset.image_normalization))
        meter, timed_dtypes = ThroughputMeter(warmup_steps=0, device=torch.device("cpu")), set()
        meter.resume()
        for _, batch in meter.timed(iterate_from(loader, 0)):
            timed_dtypes.add(batch[0].dtype)
            update.micro_step(batch, 0, 1)
        return timed_dtypes, model.state_dict()

    (in_process_dtypes, expected), (worker_dtypes, weights) = trained(0), trained(2)
    assert in_process_dtypes == {torch.float32} and worker_dtypes == {torch.uint8}
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_workers_stack_large_tensors_into_ready_shared_memory_as_default_collate_does():
    """Workers stack each large tensor of a batch into shared memory that a thread made ready while the
    batch loaded: the batches, nested views and dicts included and the last one shorter, are
    default_collate's, in every epoch."""
    from torch.utils.data import default_collate

    dataset = LargeViews()
    for epoch in (EPOCH, EPOCH + 1):
        expected = []
        for workers in (0, 2):
            loader = build_train_loader(dataset, SimpleNamespace(batch_size=4, num_workers=workers), DistEnv(), 0, False)
            start_epoch(loader, epoch)
            batches = list(loader)
            if workers == 0:
                expected = [default_collate([dataset[int(i)] for i in ids]) for _, ids, _ in batches]
            assert [len(ids) for _, ids, _ in batches] == [4, 4, 2]
            for ((first, second), ids, extra), ((first_e, second_e), ids_e, extra_e) in zip(batches, expected):
                assert torch.equal(ids, ids_e) and torch.equal(first, first_e) and torch.equal(second, second_e)
                assert torch.equal(extra["image"], extra_e["image"])


class NoisyTensors(TensorDataset):
    """A TensorDataset subclass with its own __getitem__, which draws: read sample by sample, and seeded."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image + torch.rand(()), label


def count_samples(samples: list) -> list:
    return [len(samples), *samples[0]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tensor_datasets_batches_are_default_collates_of_its_samples(workers):
    """A TensorDataset's batches, which the main process indexes at once, are default_collate's stack of its
    samples in the sampler's order (the last one shorter), in training and evaluation; a collate_fn of its own gets
    samples; a subclass with its own __getitem__ is read through it, sample by sample, with the same draws at any
    worker count."""
    from torch.utils.data import default_collate

    from ddp.loading.collate import CollatedBatch

    dataset = TensorDataset(torch.randn(11, 3, 4, 4), torch.arange(11) % 3, torch.arange(11, dtype=torch.uint8))
    config = SimpleNamespace(batch_size=4, num_workers=workers)
    for loader in (build_train_loader(dataset, config, DistEnv(rank=1, world_size=2), 0, False),
                   build_val_loader(dataset, config, DistEnv(rank=1, world_size=2), False)):
        if hasattr(loader.sampler, "set_epoch"):
            start_epoch(loader, EPOCH)
        expected = [default_collate([dataset[i] for i in ids]) for ids in loader.batch_sampler]
        batches = list(loader)
        assert [len(labels) for _, labels, _ in batches] == [len(labels) for _, labels, _ in expected] and len(batches) == 2
        for batch, batch_expected in zip(batches, expected, strict=True):
            assert type(batch) is list and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(batch, batch_expected))
    assert isinstance(build_train_loader(dataset, config, DistEnv(), 0, False).dataset.__getitems__([5, 0]), CollatedBatch)
    dataset.collate_fn = count_samples  # a dataset's own collate_fn gets samples
    assert [batch[0] for batch in build_val_loader(dataset, config, DistEnv(), False)] == [4, 4, 3]

    noisy = NoisyTensors(torch.zeros(11, 2), torch.arange(11))
    loader = build_train_loader(noisy, config, DistEnv(), 0, False)
    start_epoch(loader, EPOCH)
    images = torch.cat([images for images, _ in loader])
    assert images.unique().numel() == 11  # each sample's own draw, through its __getitem__
    reference = build_train_loader(noisy, SimpleNamespace(batch_size=4, num_workers=1 - min(workers, 1)), DistEnv(), 0, False)
    start_epoch(reference, EPOCH)
    assert torch.equal(images, torch.cat([images for images, _ in reference]))


def test_a_loader_worker_reuses_the_memory_its_samples_free(tmp_path):
    """A worker starts fresh from the fork server, where glibc's malloc would give a batch's freed images back to the
    system and fault them in again for the next batch, a page fault per 4 KiB (27 a sample on average here). Workers
    keep that memory (ddp/loading/loader_workers.py): past the first batch, photo-sized JPEGs (500x375, decoded and
    cropped to 224 px, 32 a batch) load with under one page fault a sample on average."""
    from data.vision import build_imagefolder

    root = write_imagefolder(tmp_path / "images", per_class={"train": 48, "val": 1}, size=(500, 375), suffix=".jpg")
    dataset = PageFaults(build_imagefolder(str(root), image_size=224, augment="standard", random_erase=0.0,
                                           interpolation="bilinear").train)
    loader = build_train_loader(dataset, SimpleNamespace(batch_size=32, num_workers=1), DistEnv(), 0, False)
    start_epoch(loader, EPOCH)
    assert len(list(loader)) == 3 and int(dataset.faults.min()) >= 0
    past_the_first_batch = [int(dataset.faults[index]) for index in loader.sampler.indices()[32:]]
    assert sum(past_the_first_batch) / len(past_the_first_batch) <= 4, past_the_first_batch


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_worker_decodes_a_batchs_images_into_the_shared_memory_that_is_the_batch(split, tmp_path):
    """In a loader worker, each decoded image is written into its place in a shared-memory segment, and the batch
    the rank receives is that segment: image i of a batch lies at i images' bytes into it, in the segment the rank
    maps, so nothing copies the images again. The last batch is shorter; the values are the process's own."""
    from data.vision import build_imagefolder
    from ddp.loading.batches import to_device

    root = write_imagefolder(tmp_path / "images", per_class={"train": 5, "val": 5}, size=(40, 30))
    splits = build_imagefolder(str(root), image_size=16, augment="standard", random_erase=0.0, interpolation="bilinear")
    dataset = ImageSegments(getattr(splits, split))

    def loaded(workers: int) -> tuple[list[int], list]:
        data_cfg = SimpleNamespace(batch_size=4, num_workers=workers)
        if split == "train":
            loader = build_train_loader(dataset, data_cfg, DistEnv(), 0, False)
            start_epoch(loader, EPOCH)
            order = loader.sampler.indices()
        else:
            loader = build_val_loader(dataset, data_cfg, DistEnv(), False)
            order = list(loader.sampler)
        normalization = loader.dataset.image_normalization
        return order, [(segment_of(images), to_device(images, torch.device("cpu"), normalization=normalization)) for images, _ in loader]

    _, in_process = loaded(0)
    order, from_workers = loaded(1)
    assert [len(images) for _, images in from_workers] == [4, 4, 2]
    for number, ((inode, offset), images) in enumerate(from_workers):
        assert inode != -1 and offset == 0
        samples = order[4 * number:4 * number + 4]
        assert [tuple(dataset.segments[index].tolist()) for index in samples] == [(inode, i * 3 * 16 * 16) for i in range(len(samples))]
        assert torch.equal(images, in_process[number][1])
