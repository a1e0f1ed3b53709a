"""`make bench`'s data path, on an ImageFolder of ImageNet-like JPEGs (500x375, quality 90, cut from
scikit-learn's two bundled photos; nothing is downloaded) with imagefolder's default preset at 64 px:

- the loader's images/s with each sample's draws seeded (ddp/loading/sample_seeds.py) against the same
  loader unseeded, interleaved repeats in one process and one thread, samples loaded in that process;
- a resume's cost: from the launch of `train.py resume=<checkpoint>` to the end of its first update,
  for checkpoints 10% and 90% into an epoch (the run stops at that update: the rest is the same for both).
"""

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    batch_size: int = 32
    image_size: int = 64


DATA_FULL = DataSettings(images=2000, loader_images=640, repeats=5)
DATA_QUICK = DataSettings(images=64, loader_images=64, repeats=1, batch_size=8)


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
    """{"seeded" | "unseeded": images/s per repeat}: one epoch's first loader_images images each time."""
    from torch.utils.data import DataLoader

    from data.vision import build_imagefolder
    from ddp.distributed.env import DistEnv
    from ddp.loading.loaders import build_train_loader, start_epoch
    from ddp.loading.samplers import TrainSampler

    torch.set_num_threads(1)
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
              "data.num_workers=2", "model.channels=[16,32]", "checkpoint.keep_best=0", "trainer.log_every_n_steps=1"]
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


def report(seeding: dict[str, list[float]], resumes: dict[str, list[float]], settings: DataSettings) -> tuple[list[str], list[tuple]]:
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
    return lines, rows
