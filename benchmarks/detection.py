"""make bench's detection section: train.py (task=detection, strategy=single) against a plain loop in the shape of
torchvision's references/detection/engine.py `train_one_epoch`, on the same model and data.

The plain loop is this file run as a script: a DataLoader over data=detection_shapes' train split
(build_detection_shapes with the same options, its own collate_fn, the references' DistributedSampler seeded as
train.py's, so the same batches in the same order: a detector pads a batch to its largest image), the same detector
(build_detection_model), SGD, and per step what the references do on one process: `loss_dict = model(images,
targets)`, `losses = sum(loss_dict.values())`, `losses.item()` (the references' finite check and logging: a host
sync), `optimizer.zero_grad()`, `losses.backward()`, `optimizer.step()`. Nothing else: no LR warm-up (train.py runs
scheduler=none), no logger.

Both measure the same way: images/s over the steps after `warmup` (train.py's `samples_per_s`: data loading
included), and the peak memory as train.py's results.json gives it on CPU, the process's peak RSS from the start
of the run (ddp/reporting/meter.py: VmHWM reset once the imports are done, read after training). One thread per
process, CPU, one process each, a fresh process per run; interleaved repeats, each contender first in every other
one; median (min-max).

    PYTHONPATH=. python benchmarks/detection.py --model small_fcos --steps 100   # the plain loop alone: one JSON line
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("plain loop", "train.py")


@dataclass(frozen=True)
class DetectionSettings:
    models: tuple[str, ...]  # models.detection's small detectors
    steps: int  # timed steps per run, after the warm-up
    warmup: int
    repeats: int
    batch_size: int = 4  # images per step, as detectors train (the references: 2 a GPU)
    image_size: int = 64  # data.image_size: the images' shorter side; the longer is 1-2x it
    lr: float = 0.01


# a step at batch 4 takes about 50 ms (small_fcos) or 80 ms (small_fasterrcnn) on one thread: 200 steps are 10-16 s,
# long enough that a process's start and a stray pause weigh little; the rest of the spread is the machine's, which
# the ratio of each repeat's adjacent pair of runs, and the median of 7 of them, leave out
DETECTION_FULL = DetectionSettings(models=("small_fcos", "small_fasterrcnn"), steps=200, warmup=5, repeats=7)
DETECTION_QUICK = DetectionSettings(models=("small_fcos",), steps=4, warmup=2, repeats=1, image_size=32)


def command(contender: str, model: str, settings: DetectionSettings, run_dir: Path) -> list[str]:
    """One run's command line: both contenders train (warmup + steps) steps of the same batches' sizes."""
    if contender == "plain loop":
        return [sys.executable, __file__, "--model", model, "--steps", str(settings.steps), "--warmup", str(settings.warmup),
                "--batch-size", str(settings.batch_size), "--image-size", str(settings.image_size), "--lr", str(settings.lr)]
    samples = (settings.warmup + settings.steps) * settings.batch_size  # one epoch of exactly that many steps
    return [sys.executable, str(REPO / "train.py"), "strategy=single", "task=detection", "model=detection", f"model.name={model}",
            "data=detection_shapes", f"data.num_samples={samples}", "data.num_val_samples=2", f"data.image_size={settings.image_size}",
            f"data.batch_size={settings.batch_size}", "optim=sgd", f"optim.lr={settings.lr}", "optim.momentum=0.9",
            "optim.weight_decay=0.0001", "trainer.max_epochs=1", f"trainer.warmup_steps={settings.warmup}",
            "checkpoint.every_n_steps=0", f"hydra.run.dir={run_dir}"]


def detection_runs(settings: DetectionSettings, scratch: Path) -> dict[tuple[str, str], list[dict]]:
    """{(model, contender): [{samples_per_s, peak_memory_mb, wall_s}, one per repeat]}."""
    found: dict[tuple[str, str], list[dict]] = {(model, name): [] for model in settings.models for name in CONTENDERS}
    path_with_repo = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path_with_repo}
    for repeat in range(settings.repeats):
        for model in settings.models:
            for name in CONTENDERS[::1 if repeat % 2 else -1]:
                print(f"bench: detection, repeat {repeat + 1}/{settings.repeats}: {model} {name}", flush=True)
                run_dir = scratch / f"detection{len(list(scratch.glob('detection*')))}"
                started = time.perf_counter()
                result = subprocess.run(command(name, model, settings, run_dir), cwd=scratch, env=env, capture_output=True, text=True)
                wall_s = time.perf_counter() - started
                if result.returncode != 0:
                    sys.exit(f"bench: detection {model} {name} failed:\n{result.stderr[-3000:]}")
                if name == "plain loop":
                    measured = json.loads(result.stdout.strip().splitlines()[-1])
                else:
                    measured = json.loads((run_dir / "results.json").read_text())
                found[model, name].append({"samples_per_s": measured["samples_per_s"], "peak_memory_mb": measured["peak_memory_mb"],
                                           "wall_s": wall_s})
    return found


def report(runs: dict[tuple[str, str], list[dict]], settings: DetectionSettings) -> tuple[list[str], list[tuple]]:
    """The section's table lines and its ratio rows (what, ratio, goal)."""
    def cell(found: list[dict], key: str, digits: int) -> str:
        values = [run[key] for run in found]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    def median_ratio(model: str, key: str) -> float:
        """The median over repeats of train.py's over the plain loop's: each repeat's two runs are adjacent in time,
        so a load the machine had for a while weighs on both of the pair."""
        return statistics.median(mine[key] / theirs[key] for mine, theirs in zip(runs[model, "train.py"], runs[model, "plain loop"]))

    lines = ["", f"Detection: train.py task=detection strategy=single against a plain loop of torchvision's references' "
             f"train_one_epoch (benchmarks/detection.py), data=detection_shapes at image_size {settings.image_size}, batch "
             f"{settings.batch_size}, SGD, one process, one thread; {settings.warmup} warm-up + {settings.steps} timed steps; "
             f"peak memory: the process's peak RSS from the start of the run (train.py's peak_memory_mb on CPU); "
             f"{settings.repeats} interleaved repeats, median (min-max); a ratio is the median of the repeats' ratios.", "",
             "| model | contender | images/s | peak memory, MB | whole-process wall s |", "|---|---|---|---|---|"]
    lines += [f"| {model} | {name} | {cell(found, 'samples_per_s', 1)} | {cell(found, 'peak_memory_mb', 0)} | "
              f"{cell(found, 'wall_s', 2)} |" for (model, name), found in runs.items()]
    rows = []
    for model in settings.models:
        rows.append((f"detection: train.py / plain loop (references' train_one_epoch), images/s, {model}",
                     median_ratio(model, "samples_per_s"), ">= 0.97"))
        rows.append((f"detection: train.py / plain loop, peak memory (peak RSS), {model}", median_ratio(model, "peak_memory_mb"), "<= 1.05"))
    return lines, rows


def plain_loop() -> None:
    """The references' train_one_epoch on one process; prints {samples_per_s, peak_memory_mb} as one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small_fcos")
    parser.add_argument("--steps", type=int, default=100, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    import torch  # here, not at the top: bench.py imports this module before the project is on its path
    from torch.utils.data import DataLoader, DistributedSampler

    from data.detection_shapes import build_detection_shapes
    from ddp.reporting.meter import peak_memory, reset_peak_memory
    from models.detection import build_detection_model

    memory_reset = reset_peak_memory([])  # where train.py's run() starts its peak: imports done, data and model to come
    torch.manual_seed(0)
    device = torch.device("cpu")
    samples = (args.warmup + args.steps) * args.batch_size
    # data=detection_shapes' defaults (conf/data/detection_shapes.yaml) are the builder's own
    splits = build_detection_shapes(samples, 1, args.image_size)
    model = build_detection_model(splits.num_classes, splits.in_channels, args.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=0.0001)
    # the references' sampler where they run distributed, seeded as train.py's seed=0: the same batches in the same
    # order as train.py's. A detector pads a batch to its largest image, so a step's work depends on which images share it
    sampler = DistributedSampler(splits.train, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(splits.train, batch_size=args.batch_size, sampler=sampler, drop_last=True, collate_fn=splits.train.collate_fn)

    model.train()
    started = None
    for step, (images, targets) in enumerate(loader, start=1):
        images = [image.to(device) for image in images]
        targets = [{key: value.to(device) for key, value in target.items() if isinstance(value, torch.Tensor)} for target in targets]
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()  # the references' host sync: their finite check and their logging
        if not math.isfinite(loss_value):
            sys.exit(f"plain loop: loss is {loss_value} at step {step}, stopping training")
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        if step == args.warmup:
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    print(json.dumps({"samples_per_s": args.steps * args.batch_size / seconds, "peak_memory_mb": peak_memory([], memory_reset)[0]}))


if __name__ == "__main__":
    plain_loop()
