"""`make bench`'s data path, on an ImageFolder of ImageNet-like JPEGs (500x375, quality 90, cut from
scikit-learn's two bundled photos; nothing is downloaded) with imagefolder's default preset at 64 px:

- the loader's images/s with each sample's draws seeded (ddp/loading/sample_seeds.py) against the same
  loader unseeded, interleaved repeats in one fresh process and one thread, samples loaded in that process;
- a resume's cost: from the launch of `train.py resume=<checkpoint>` to the end of its first update,
  for checkpoints 10% and 90% into an epoch (the run stops at that update: the rest is the same for both);
- the input pipeline at 224 px (the `standard` training preset), images/s through the project's train
  loader with 1 and 2 workers, from the same JPEGs stored as ImageFolder files, local tar shards
  (`data=webdataset`), tar shards over HTTP through the node cache (cold, then warm) and Hugging Face
  Arrow (`data=hf`), against its limit: the same decode and transform of the same bytes already in
  memory, in one process. Both stop where a worker stops, at uint8 images: the rank normalizes the
  batch on its device (ddp/loading/batches.py).
"""

import functools
import http.server
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the project's loaders, as train.py imports them

PHOTO_SIZE = (500, 375)


@dataclass(frozen=True)
class DataSettings:
    images: int  # training JPEGs, half a class
    loader_images: int  # images loaded per loader measurement
    repeats: int
    # the input pipeline's: one repeat's ratio to the limit moves by about 6% on a shared 2-core machine (memory
    # traffic on the other core slows a decode by up to a third), so its median needs more of them than the other rows
    pipeline_repeats: int
    batch_size: int = 32
    image_size: int = 64
    pipeline_size: int = 224  # the input pipeline's crops, ImageNet's training size
    samples_per_shard: int = 250
    resume_workers: int = 2  # the resume rows' loader workers (quick: none, the tool's path only; each worker pool adds a process)


DATA_FULL = DataSettings(images=2000, loader_images=960, repeats=5, pipeline_repeats=15)
DATA_QUICK = DataSettings(images=64, loader_images=64, repeats=1, pipeline_repeats=1, batch_size=8, pipeline_size=32, samples_per_shard=16,
                          resume_workers=0)
# what a loader reads from, at 1 and 2 workers (cold HTTP: at 1, its cache emptied before each repeat)
PIPELINE = [("files", 1), ("local shards", 1), ("HTTP shards, cold cache", 1), ("HTTP shards, warm cache", 1), ("hf Arrow", 1),
            ("files", 2), ("local shards", 2), ("HTTP shards, warm cache", 2), ("hf Arrow", 2)]
SHARD_WINDOW = 2  # the shard contenders' data.shuffle_window: the setting for remote shards (prefetch)


def write_photos(root: Path, images: int) -> Path:
    """root/{train,val}/{china,flower}/*.jpg: 500x375 crops of the photos (scaled up first), at random places."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(0)
    for split, count in (("train", images // 2), ("val", 10)):
        for name, photo in zip(("china", "flower"), load_sample_images().images):
            folder = root / split / name
            folder.mkdir(parents=True)
            big = Image.fromarray(photo).resize((photo.shape[1] * 2, photo.shape[0] * 2))
            for i in range(count):
                left, top = int(rng.integers(0, big.width - PHOTO_SIZE[0])), int(rng.integers(0, big.height - PHOTO_SIZE[1]))
                big.crop((left, top, left + PHOTO_SIZE[0], top + PHOTO_SIZE[1])).save(folder / f"{i}.jpg", quality=90)
    return root


def loader_seeding(root: Path, settings: DataSettings) -> dict[str, list[float]]:
    """{"seeded" | "unseeded": images/s per repeat}: one epoch's first loader_images images each time, in a fresh
    process that keeps the memory it frees, as a rank does. In the bench's own process, after most of an hour of
    launching contenders, the ratio landed anywhere from 0.85 to 0.98 from run to run (docs/performance.md)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_loader_seeding_in_this_process, (root, settings))


def _loader_seeding_in_this_process(root: Path, settings: DataSettings) -> dict[str, list[float]]:
    from torch.utils.data import DataLoader

    from data.vision import build_imagefolder
    from ddp.distributed.env import DistEnv, keep_freed_host_memory
    from ddp.loading.loaders import build_train_loader, start_epoch
    from ddp.loading.samplers import TrainSampler

    torch.set_num_threads(1)
    keep_freed_host_memory()
    train = build_imagefolder(str(root), settings.image_size, "standard", 0.0, "bilinear").train
    config = type("Data", (), {"batch_size": settings.batch_size, "num_workers": 0})
    seeded = build_train_loader(train, config, DistEnv(), seed=0, pin_memory=False)
    unseeded = DataLoader(train, batch_size=settings.batch_size, sampler=TrainSampler(train, num_replicas=1, rank=0, seed=0))
    found: dict[str, list[float]] = {"seeded": [], "unseeded": []}
    batches = settings.loader_images // settings.batch_size
    for repeat in range(-1, settings.repeats):  # -1: a warm-up of both (the files into the page cache)
        contenders = [("seeded", seeded), ("unseeded", unseeded)]
        for name, loader in contenders[::1 if repeat % 2 else -1]:  # each first in every other repeat
            start_epoch(seeded, repeat + 1) if name == "seeded" else unseeded.sampler.set_epoch(repeat + 1)
            started = time.perf_counter()
            for _, _ in zip(range(batches), loader):
                pass
            if repeat >= 0:
                found[name].append(batches * settings.batch_size / (time.perf_counter() - started))
    return found


def resume_cost(root: Path, settings: DataSettings, scratch: Path) -> dict[str, list[float]]:
    """{"10%" | "90%": seconds from launch to the end of the first update of a resume, per repeat}."""
    steps_per_epoch = settings.images // settings.batch_size
    common = ["data=imagefolder", f"data.root={root}", f"data.image_size={settings.image_size}", f"data.batch_size={settings.batch_size}",
              f"data.num_workers={settings.resume_workers}", "model.channels=[16,32]", "checkpoint.keep_best=0", "trainer.log_every_n_steps=1"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    checkpoints = {}
    scratch.mkdir(exist_ok=True)
    for name, fraction in (("10%", 0.1), ("90%", 0.9)):
        step = max(1, round(fraction * steps_per_epoch))
        run_dir = scratch / f"stop-{step}"
        subprocess.run([sys.executable, str(REPO / "train.py"), *common, f"trainer.max_steps={step}", f"hydra.run.dir={run_dir}"],
                       cwd=scratch, env=env, check=True, capture_output=True)
        checkpoints[name] = (run_dir / "checkpoints" / "last.pt", step)
    found: dict[str, list[float]] = {name: [] for name in checkpoints}
    for repeat in range(settings.repeats):
        for name, (checkpoint, step) in checkpoints.items():
            run_dir = scratch / f"resume-{name[:-1]}-{repeat}"
            command = [sys.executable, str(REPO / "train.py"), *common, f"resume={checkpoint}", f"trainer.max_steps={step + 1}",
                       "trainer.val_every_n_epochs=1000", f"hydra.run.dir={run_dir}"]
            started = time.time()
            subprocess.run(command, cwd=scratch, env=env, check=True, capture_output=True)
            found[name].append(first_update_at(run_dir, step + 1) - started)
    return found


def first_update_at(run_dir: Path, step: int) -> float:
    """The wall time at which update `step`'s train/loss was logged (trainer.log_every_n_steps=1), as
    TensorBoard's event file records it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    (event,) = [event for event in accumulator.Scalars("train/loss") if event.step == step]
    return event.wall_time


def input_pipeline(root: Path, settings: DataSettings, scratch: Path) -> dict[str, list[tuple[float, float]]]:
    """{"<storage>, <n> worker(s)": [(its images/s, the limit's around it), per repeat]}, each
    repeat's contenders interleaved. A loader's rate is its steady state: counted once each worker
    has delivered its first batch (a worker's start, once an epoch, is left out as the limit has
    none), to its last; each repeat reads a fresh epoch's order, `loader_images` images in all. The
    limit decodes and transforms the very images that the contender counted, half of them just before
    it and half just after (this machine's speed drifts by a third within minutes)."""
    from data.presets import imagefolder_transforms
    from data.encoded import decode_image
    from data.shards import convert
    from ddp.loading.loader_workers import start_fork_server
    from ddp.loading.samplers import epoch_order

    torch.set_num_threads(1)
    # the loader workers' fork server, with every contender's modules imported (train.py's imports one dataset's)
    start_fork_server(["torch", "data.vision", "data.webdataset", "data.hf", *(["datasets"] if HF_DATASETS else [])])
    shards = scratch / "shards"
    convert(shards, ["data=imagefolder", f"data.root={root}"], settings.samples_per_shard)
    pattern = f"train-{{000000..{len(list(shards.glob('train-*.tar'))) - 1:06d}}}.tar"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(shards)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    storages = {"files": lambda cache: ("imagefolder", {"root": str(root)}),
                "local shards": lambda cache: ("webdataset", {"train_shards": f"{shards}/{pattern}", "val_shards": f"{shards}/val-000000.tar"}),
                "HTTP shards": lambda cache: ("webdataset", {"train_shards": f"{url}/{pattern}", "val_shards": f"{url}/val-000000.tar",
                                                             "cache_dir": str(cache)})}
    if HF_DATASETS:
        hf_folder = write_hf(root, scratch / "hf")
        storages["hf Arrow"] = lambda cache: ("hf", {"path": str(hf_folder)})
    transform, _, normalization = imagefolder_transforms(settings.pipeline_size, "standard", 0.0, "bilinear")
    normalization.deferred = True  # the limit does a loader worker's work: images to uint8, normalized on the device
    # ImageFolder's order, which the shards and the Arrow table keep: sample i of every storage is files[i]
    encoded = [path.read_bytes() for path in sorted((root / "train").glob("*/*.jpg"))]

    def limit_seconds(indices: list[int]) -> float:
        started = time.perf_counter()
        for index in indices:
            transform(decode_image(encoded[index]))
        return time.perf_counter() - started

    def measure(storage: str, workers: int, epoch: int) -> tuple[float, float]:
        """(the loader's images/s, the limit's on the images it counted)."""
        name = storage.split(",")[0]
        if name not in storages:
            return float("nan"), float("nan")
        cache = scratch / (f"cold-{epoch}" if "cold" in storage else "warm")
        option, keys = storages[name](cache)
        dataset, window = build_split(option, keys, settings.pipeline_size), SHARD_WINDOW if "shards" in storage else 0
        counted = epoch_order(len(dataset), 0, epoch, dataset.shard_sizes if window else None, window)[
            workers * settings.batch_size:settings.loader_images // settings.batch_size * settings.batch_size]
        seconds = limit_seconds(counted[::2])
        rate = images_per_second(dataset, workers, epoch, settings, window)
        return rate, len(counted) / (seconds + limit_seconds(counted[1::2]))

    try:
        measure("HTTP shards, warm cache", 1, epoch=0)  # fills the warm cache; the files into the page cache
        measure("files", 1, epoch=0)
        found: dict[str, list[tuple[float, float]]] = {pipeline_name(*contender): [] for contender in PIPELINE}
        for repeat in range(settings.pipeline_repeats):
            for storage, workers in PIPELINE[::1 if repeat % 2 else -1]:
                found[pipeline_name(storage, workers)].append(measure(storage, workers, epoch=repeat + 1))
    finally:
        server.shutdown()
    return found


def pipeline_name(storage: str, workers: int) -> str:
    return f"{storage}, {workers} worker{'s' if workers > 1 else ''}"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def build_split(option: str, keys: dict, image_size: int):
    """The training split of data=<option> with these data.* keys, built as train.py builds it."""
    from data.hf import build_hf
    from data.vision import build_imagefolder
    from data.webdataset import build_webdataset

    builder = {"imagefolder": build_imagefolder, "webdataset": build_webdataset, "hf": build_hf}[option]
    return builder(**keys, image_size=image_size, augment="standard", random_erase=0.0, interpolation="bilinear").train


def images_per_second(dataset, workers: int, epoch: int, settings: DataSettings, window: int) -> float:
    from ddp.distributed.env import DistEnv
    from ddp.loading.loaders import build_train_loader, start_epoch

    config = SimpleNamespace(batch_size=settings.batch_size, num_workers=workers, shuffle_window=window)
    loader = build_train_loader(dataset, config, DistEnv(), seed=0, pin_memory=False)
    start_epoch(loader, epoch)
    batches = iter(loader)
    for _ in range(max(workers, 1)):  # each worker started and its first batch in: from here, the steady state
        next(batches)
    started, count = time.perf_counter(), 0
    for _, (images, _) in zip(range(settings.loader_images // settings.batch_size - max(workers, 1)), batches):
        count += len(images)
    rate = count / (time.perf_counter() - started)
    del batches  # its workers stop
    return rate


try:
    import datasets  # noqa: F401 (data=hf's library: the optional extra hf, which make bench installs)

    HF_DATASETS = True
except ImportError:
    HF_DATASETS = False


def write_hf(root: Path, folder: Path) -> Path:
    """The ImageFolder's train and val files as a DatasetDict of their bytes (docs/sharded-data.md), saved."""
    import datasets
    from torchvision.datasets import ImageFolder

    splits = {}
    for name, split in (("train", "train"), ("val", "validation")):
        images = ImageFolder(str(root / name))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=images.classes)})
        splits[split] = datasets.Dataset.from_dict(
            {"image": [{"bytes": Path(path).read_bytes(), "path": None} for path, _ in images.samples],
             "label": [label for _, label in images.samples]}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def report(seeding: dict[str, list[float]], resumes: dict[str, list[float]], pipeline: dict[str, list[tuple[float, float]]],
           settings: DataSettings) -> tuple[list[str], list[tuple]]:
    """The data path's table lines, and its ratio rows (what, ratio, goal)."""
    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    lines = ["", f"Data path: an ImageFolder of {settings.images} JPEGs (500x375), imagefolder's default preset at "
             f"{settings.image_size} px, batch {settings.batch_size}; {settings.repeats} interleaved repeats, median (min-max).", "",
             "| measurement | value |", "|---|---|"]
    lines += [f"| loader images/s, {name}, one process, no workers | {cell(values, 1)} |" for name, values in seeding.items()]
    lines += [f"| resume {name} into an epoch: launch to the end of its first update, s | {cell(values, 2)} |"
              for name, values in resumes.items()]
    rows = [("per-sample seeding: loader images/s, seeded / unseeded",
             statistics.median(seeding["seeded"]) / statistics.median(seeding["unseeded"]), ">= 0.98"),
            ("resume cost: launch to first update, 90% / 10% into an epoch",
             statistics.median(resumes["90%"]) / statistics.median(resumes["10%"]), "<= 1.10")]
    measured = {name: pairs for name, pairs in pipeline.items() if all(rate == rate for rate, _ in pairs)}  # nan: skipped
    ratio = {name: statistics.median(rate / limit for rate, limit in pairs) for name, pairs in measured.items()}
    rate = {name: statistics.median(rate for rate, _ in pairs) for name, pairs in measured.items()}
    limits = [limit for pairs in measured.values() for _, limit in pairs]
    lines += ["", f"Input pipeline: the same JPEGs, the `standard` training preset at {settings.pipeline_size} px, "
              f"{settings.loader_images} images a measurement, from each worker's first batch on, tar shards of "
              f"{settings.samples_per_shard} with data.shuffle_window={SHARD_WINDOW}; the limit: their decode and transform "
              "to the uint8 images a worker hands over (the rank normalizes them on its device) from bytes in memory, in "
              "one process, of the very images each contender counted, half just before it and half just after "
              f"(the median of the repeats' ratios; {settings.pipeline_repeats} interleaved repeats).", "",
              "| input | images/s | / limit |", "|---|---|---|",
              f"| limit: decode + transform to uint8 in memory, one process | {cell(limits, 1)} | 1.000 |"]
    lines += [f"| {name} | {cell([rate for rate, _ in pairs], 1)} | {ratio[name]:.3f} |" for name, pairs in measured.items()]
    per_image_us = 1e6 * (1 / rate["files, 1 worker"] - 1 / rate["local shards, 1 worker"])
    lines += ["", f"A file per image instead of shards (files - local shards, 1 worker): {per_image_us:+.0f} us an image."]
    if not HF_DATASETS:
        lines += ["", "hf Arrow rows skipped: datasets is not installed (the optional extra: pip install -e '.[hf]', "
                  "which make bench installs)."]
    for name, goal in (("local shards, 1 worker", ">= 0.90"), ("HTTP shards, warm cache, 1 worker", ">= 0.90")):
        rows.append((f"input pipeline: {name} / in-memory decode limit", ratio[name], goal))
    for name in ("files", "local shards"):
        rows.append((f"input pipeline: {name}, 2 workers / 1 worker", rate[f"{name}, 2 workers"] / rate[f"{name}, 1 worker"], "report"))
    return lines, rows
