"""`make bench`: train.py against the plain hand-written DDP loop (benchmarks/plain_ddp.py) on
identical work, side by side in one run; then the data path (benchmarks/data_path.py): the loader's
images/s with per-sample seeding against without, and a resume's launch-to-first-update at 10% and at
90% of an epoch, on JPEGs; then memory and scale (benchmarks/memory_scale.py): a ViT's per-rank state
under ddp, fsdp and hsdp, its saves' time in the loop, sync and async, and what activation
checkpointing keeps for the backward and costs; then integrity checks (benchmarks/integrity.py): a checkpoint's
load with and without verification, a shard's download with and without its digest; then the shard readers
(benchmarks/shard_readers.py): one epoch over HTTP, cold cache, data=webdataset's reader and cache against
webdataset's wids; then detection (benchmarks/detection.py): train.py task=detection against a plain loop of
torchvision's references' train_one_epoch on the same detector and data, images/s and peak memory.

Every contender trains the same model on the same synthetic 3x32x32 data with Adam, batch 32 per
process, one thread per process on CPU. The contenders run interleaved (A B C ... A B C ...),
`repeats` times, and each is reported as the median and min-max of its steady-state throughput
(global samples/s over training steps after the warm-up, train.py's definition) and of its
whole-process wall time. Writes benchmarks/results/<host>-<date>.md and a PNG plot next to it, and
prints the table and the ratios with their goals.

    python benchmarks/bench.py                   # the full run (make bench)
    BENCH_QUICK=1 python benchmarks/bench.py     # a tiny version, end to end
"""

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import data_path  # noqa: E402 (benchmarks/ is no package)
import detection  # noqa: E402
import integrity  # noqa: E402
import memory_scale  # noqa: E402
import shard_readers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    steps: int  # timed steps per run, after the warm-up
    warmup: int
    repeats: int
    image_size: int = 32
    batch_size: int = 32


FULL = Settings(models=("tiny_cnn", "small_cnn", "resnet18"), steps=20, warmup=5, repeats=5)
QUICK = Settings(models=("small_cnn",), steps=4, warmup=2, repeats=1, image_size=16)


# train.py's model for each benchmark model (plain_ddp.py's MODELS); tiny_cnn is framework-bound: a step of a
# few milliseconds at 16 px, where the loop's own cost per step shows
MODEL_OVERRIDES = {"tiny_cnn": ["model=small_cnn", "model.channels=[8,16]"], "small_cnn": ["model=small_cnn"],
                   "resnet18": ["model=resnet18"]}
IMAGE_SIZES = {"tiny_cnn": 16}
# tiny_cnn's steps take a few milliseconds: 20 of them are a tenth of a second, whose time moved by +-3.8 ms a step
# from repeat to repeat on a 2-core machine (docs/performance.md); 300 resolve tenths of a millisecond
TIMED_STEPS = {"tiny_cnn": 300}
# Lightning's Trainer, with the optional extra (pip install -e '.[bench]'): benchmarks/lightning_ddp.py
LIGHTNING = importlib.util.find_spec("lightning") is not None
SCRIPTS = {"plain": "plain_ddp.py", "lightning": "lightning_ddp.py"}


@dataclass
class Contender:
    name: str
    model: str
    processes: int
    arguments: list[str]  # train.py overrides, or the script's flags for "plain" and "lightning"
    throughput: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    state_bytes: list[int] = field(default_factory=list)  # rank 0's parameters, gradients and optimizer state


def contenders(settings: Settings, quick: bool) -> list[Contender]:
    variants = {
        "ddp": (2, ["strategy=ddp"]),
        # train.py with glibc's malloc as the plain loop and Lightning have it: the loop's own cost, the allocator aside
        "ddp malloc default": (2, ["strategy=ddp", "keep_freed_host_memory=false"]),
        "ddp syncbn": (2, ["strategy=ddp", "syncbn=true"]),
        "ddp bf16": (2, ["strategy=ddp", "precision=bf16"]),
        "ddp channels_last": (2, ["strategy=ddp", "channels_last=true"]),
        "fsdp": (2, ["strategy=fsdp"]),
        "single": (1, ["strategy=single"]),
        "dp": (1, ["strategy=dp"]),
    }
    if quick:  # the contenders of the headline ratios: DDP against the plain loop, and weak scaling
        variants = {name: variants[name] for name in ("ddp", "single")}
    chosen = []
    for model in settings.models:
        chosen += [Contender(name, model, 2, ["--model", model]) for name in ("plain", "lightning") if name == "plain" or LIGHTNING]
        chosen += [Contender(name, model, processes, [*MODEL_OVERRIDES[model], *arguments])
                   for name, (processes, arguments) in variants.items() if model != "tiny_cnn" or name in ("ddp", "ddp malloc default")]
        if model == "small_cnn" and not quick:  # the trackers' cost, where the steps are short; W&B offline, as without a key
            chosen += [Contender(f"ddp +{tracker}", model, 2, [*MODEL_OVERRIDES[model], "strategy=ddp", f"logger=[tensorboard,{tracker}]",
                                                              *settings_of_tracker])
                       for tracker, settings_of_tracker in (("mlflow", []), ("wandb", ["logger.wandb.mode=offline"]))]
            # and MLflow's where a core is left for the trackers' process, as on a GPU node: 2 ranks take both of 2 cores
            chosen.append(Contender("single +mlflow", model, 1,
                                    [*MODEL_OVERRIDES[model], "strategy=single", "logger=[tensorboard,mlflow]"]))
    if torch.cuda.is_available():  # one GPU: resnet50 at batch 256 in bf16, channels_last; DDP at world size 1
        gpu = ["model=torchvision", "model.name=resnet50", "precision=bf16", "channels_last=true"]
        chosen += [Contender("gpu single", "resnet50", 1, ["strategy=single", *gpu]),
                   Contender("gpu ddp x1", "resnet50", 1, ["strategy=ddp", *gpu])]
    return chosen


def command(contender: Contender, settings: Settings, run_dir: Path) -> list[str]:
    gpu = contender.model == "resnet50"
    batch, image_size = (256, 224) if gpu else (settings.batch_size, IMAGE_SIZES.get(contender.model, settings.image_size))
    steps = TIMED_STEPS.get(contender.model, settings.steps)
    launcher = [str(TORCHRUN), "--standalone", f"--nproc_per_node={contender.processes}"]
    if contender.name in SCRIPTS:
        return [*launcher, str(REPO / "benchmarks" / SCRIPTS[contender.name]), *contender.arguments, "--steps", str(steps),
                "--warmup", str(settings.warmup), "--batch-size", str(batch), "--image-size", str(image_size)]
    samples = (settings.warmup + steps) * batch * contender.processes  # one epoch of exactly that many steps
    overrides = [*contender.arguments, "data=synthetic", f"data.num_samples={samples}", f"data.num_val_samples={batch}",
                 f"data.image_size={image_size}", f"data.batch_size={batch}", "optim=adam", "trainer.max_epochs=1",
                 f"trainer.warmup_steps={settings.warmup}", "checkpoint.every_n_steps=0", f"hydra.run.dir={run_dir}"]
    if contender.name.startswith(("ddp", "fsdp", "gpu ddp")):
        return [*launcher, str(REPO / "train.py"), *overrides]
    return [sys.executable, str(REPO / "train.py"), *overrides]


def run_once(contender: Contender, settings: Settings, scratch: Path) -> None:
    run_dir = scratch / f"run{len(list(scratch.iterdir()))}"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if contender.model != "resnet50":  # the CPU rows run on CPU on every host, also where a GPU is visible
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    result = subprocess.run(command(contender, settings, run_dir), cwd=scratch, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"bench: {contender.name} ({contender.model}) failed:\n{result.stderr[-3000:]}")
    if contender.name in SCRIPTS:
        throughput = json.loads(result.stdout.strip().splitlines()[-1])["samples_per_s"]
    else:
        results = json.loads((run_dir / "results.json").read_text())
        throughput = results["samples_per_s"]
        contender.state_bytes.append(sum(results[f"{kind}_bytes_per_rank"][0] for kind in ("parameter", "gradient", "optimizer_state")))
    contender.throughput.append(throughput)
    contender.wall.append(wall)


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], digits: int) -> str:
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratios(found: dict[tuple[str, str], Contender], batch_size: int) -> list[tuple[str, float, str]]:
    """(what, measured ratio, goal) for every ratio whose contenders ran."""
    def throughput(name, model):
        return median(found[name, model].throughput)

    rows = []
    for model, goal in (("tiny_cnn", "-"), ("small_cnn", ">= 0.99"), ("resnet18", ">= 0.99")):
        if ("ddp", model) in found:
            rows.append((f"train.py DDP / plain loop, throughput, {model}", throughput("ddp", model) / throughput("plain", model), goal))
        if ("ddp", model) in found and ("lightning", model) in found:
            rows.append((f"train.py DDP / Lightning, throughput, {model}", throughput("ddp", model) / throughput("lightning", model),
                         ">= 1.00" if model != "resnet18" else "for the record"))
        if ("ddp malloc default", model) in found:
            rows.append((f"train.py DDP, keep_freed_host_memory=false / plain loop, throughput, {model}",
                         throughput("ddp malloc default", model) / throughput("plain", model), goal))
            rows.append((f"keep_freed_host_memory=true / false, throughput, {model}, 2 ranks",
                         throughput("ddp", model) / throughput("ddp malloc default", model), "for the record"))
    for name, what in (("ddp", "train.py DDP"), ("ddp malloc default", "train.py DDP, keep_freed_host_memory=false")):
        if (name, "tiny_cnn") in found:  # the loop's own cost: a step's time over the plain loop's, in ms
            step_samples = found[name, "tiny_cnn"].processes * batch_size
            rows.append((f"{what} - plain loop, time per step (ms), tiny_cnn",
                         1000 * step_samples * (1 / throughput(name, "tiny_cnn") - 1 / throughput("plain", "tiny_cnn")), "<= 0.30"))
    for model, goal in (("small_cnn", "<= 1.10"), ("resnet18", "<= 1.08")):  # start-up and the end of a run included
        if ("ddp", model) in found:
            rows.append((f"train.py DDP / plain loop, whole-process wall time, {model}",
                         median(found["ddp", model].wall) / median(found["plain", model].wall), goal))
    for model in ("resnet18", "small_cnn"):
        if ("ddp syncbn", model) in found:
            rows.append((f"syncbn=true / syncbn=false, step time, {model}, 2 ranks",
                         throughput("ddp", model) / throughput("ddp syncbn", model), "<= 1.15" if model == "resnet18" else "-"))
        if ("single", model) in found:
            rows.append((f"weak scaling: per-rank throughput, 2 ranks / 1 rank, {model}",
                         throughput("ddp", model) / 2 / throughput("single", model), ">= 0.9"))
        for name, what in (("ddp bf16", "bf16 / fp32"), ("ddp channels_last", "channels_last / NCHW"), ("fsdp", "fsdp / ddp")):
            if (name, model) in found:
                rows.append((f"{what}, throughput, {model}, 2 ranks", throughput(name, model) / throughput("ddp", model), "for the record"))
        if ("fsdp", model) in found:
            rows.append((f"fsdp / ddp, rank 0's bytes of parameters, gradients and optimizer state, {model}, 2 ranks",
                         median(found["fsdp", model].state_bytes) / median(found["ddp", model].state_bytes), "<= 0.55"))
    for tracker in ("mlflow", "wandb"):
        if (f"ddp +{tracker}", "small_cnn") in found:
            contender = found[f"ddp +{tracker}", "small_cnn"]
            rows.append((f"logger=[tensorboard,{tracker}] / tensorboard, throughput, small_cnn, 2 ranks",
                         median(contender.throughput) / throughput("ddp", "small_cnn"), "for the record"))
            rows.append((f"logger=[tensorboard,{tracker}] / tensorboard, whole-process wall time, small_cnn, 2 ranks",
                         median(contender.wall) / median(found["ddp", "small_cnn"].wall),
                         "<= 1.05" if tracker == "mlflow" else "for the record"))
    if ("single +mlflow", "small_cnn") in found:
        with_it, without = found["single +mlflow", "small_cnn"], found["single", "small_cnn"]
        rows.append(("logger=[tensorboard,mlflow] / tensorboard, whole-process wall time, small_cnn, 1 process, a core to spare",
                     median(with_it.wall) / median(without.wall), "<= 1.05"))
    if ("gpu ddp x1", "resnet50") in found:
        rows.append(("GPU: DDP at world size 1 / single, resnet50", throughput("gpu ddp x1", "resnet50") / throughput("gpu single", "resnet50"), ">= 0.97"))
    return rows


def meets(ratio: float, goal: str) -> str:
    if goal.startswith(">="):
        return "yes" if ratio >= float(goal[2:]) else "no"
    if goal.startswith("<="):
        return "yes" if ratio <= float(goal[2:]) else "no"
    return ""


def report(chosen: list[Contender], settings: Settings, quick: bool, data_lines: list[str], data_rows: list[tuple]) -> str:
    found = {(c.name, c.model): c for c in chosen}
    lines = [
        f"# make bench{' (BENCH_QUICK)' if quick else ''}: {socket.gethostname()}, {date.today()}",
        "",
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{'CUDA: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
        f"one thread per process; {settings.warmup} warm-up + {settings.steps} timed steps (tiny_cnn: {TIMED_STEPS['tiny_cnn']}) of batch {settings.batch_size} "
        f"per process on synthetic 3x{settings.image_size}x{settings.image_size} images, Adam; {settings.repeats} "
        "interleaved repeats, median (min-max).",
        "",
        "| model | contender | processes | samples/s | whole-process wall s |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {c.model} | {c.name} | {c.processes} | {spread(c.throughput, 1)} | {spread(c.wall, 2)} |" for c in chosen]
    if not LIGHTNING:
        lines += ["", "Lightning rows skipped: Lightning is not installed (the optional extra: pip install -e '.[bench]', "
                  "which make bench installs)."]
    lines += data_lines
    lines += ["", "| ratio | measured | goal | met |", "|---|---|---|---|"]
    lines += [f"| {what} | {ratio:.3f} | {goal} | {meets(ratio, goal)} |" for what, ratio, goal in ratios(found, settings.batch_size) + data_rows]
    if ("gpu single", "resnet50") in found:
        lines += ["", f"GPU resnet50, batch 256, bf16, channels_last: {median(found['gpu single', 'resnet50'].throughput):.0f} img/s "
                  "(NVIDIA's A100 AMP figure for resnet50 training: about 2,470 img/s)."]
    return "\n".join(lines) + "\n"


def plot(chosen: list[Contender], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c.model for c in chosen))
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models):
        mine = [c for c in chosen if c.model == model]
        medians = [median(c.throughput) for c in mine]
        errors = [[m - min(c.throughput) for m, c in zip(medians, mine)], [max(c.throughput) - m for m, c in zip(medians, mine)]]
        axis.barh([c.name for c in mine], medians, xerr=errors, color=["grey" if c.name == "plain" else "tab:blue" for c in mine])
        axis.set_title(model)
        axis.set_xlabel("samples/s (median, min-max bars)")
        axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder for the .md and .png")
    args = parser.parse_args()
    # the project's packages for this process and every contender, also with a Python it isn't installed in (docs/gpus.md)
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    quick = os.environ.get("BENCH_QUICK", "0") == "1"
    settings = QUICK if quick else FULL
    chosen = contenders(settings, quick)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(settings.repeats):
            for contender in chosen:
                print(f"bench: repeat {repeat + 1}/{settings.repeats}: {contender.model} {contender.name}", flush=True)
                run_once(contender, settings, Path(scratch))
        data_settings = data_path.DATA_QUICK if quick else data_path.DATA_FULL
        print(f"bench: the data path, {data_settings.images} JPEGs", flush=True)
        photos = data_path.write_photos(Path(scratch) / "photos", data_settings.images)
        seeding = data_path.loader_seeding(photos, data_settings)
        resumes = data_path.resume_cost(photos, data_settings, Path(scratch) / "resumes")
        print("bench: the input pipeline: files, tar shards (local, HTTP), Arrow", flush=True)
        pipeline = data_path.input_pipeline(photos, data_settings, Path(scratch) / "pipeline")
        scale_settings = memory_scale.SCALE_QUICK if quick else memory_scale.SCALE_FULL
        scale = memory_scale.scale_runs(scale_settings, Path(scratch))
        print("bench: memory and scale: activation checkpointing, in this process", flush=True)
        scale_lines, scale_rows = memory_scale.report(scale, memory_scale.activation_memory(scale_settings), scale_settings)
        integrity_settings = integrity.INTEGRITY_QUICK if quick else integrity.INTEGRITY_FULL
        checks = integrity.integrity_runs(integrity_settings, Path(scratch))
        readers_settings = shard_readers.READERS_QUICK if quick else shard_readers.READERS_FULL
        readers = shard_readers.reader_runs(readers_settings, Path(scratch)) if shard_readers.WIDS else None
        detection_settings = detection.DETECTION_QUICK if quick else detection.DETECTION_FULL
        detection_found = detection.detection_runs(detection_settings, Path(scratch))
    data_lines, data_rows = data_path.report(seeding, resumes, pipeline, data_settings)
    integrity_lines, integrity_rows = integrity.report(*checks, integrity_settings)
    if readers is not None:
        readers_lines, readers_rows = shard_readers.report(*readers, readers_settings)
    else:
        readers_lines, readers_rows = ["", "Shard readers skipped: wids is not installed (the optional extra: pip install -e '.[bench]', "
                                       "which make bench installs)."], []
    detection_lines, detection_rows = detection.report(detection_found, detection_settings)
    table = report(chosen, settings, quick, data_lines + scale_lines + integrity_lines + readers_lines + detection_lines,
                   data_rows + scale_rows + integrity_rows + readers_rows + detection_rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{socket.gethostname()}-{date.today()}{'-quick' if quick else ''}"
    Path(f"{stem}.md").write_text(table + f"\n![throughput]({stem.name}.png)\n")
    plot(chosen, Path(f"{stem}.png"))
    print(table)
    print(f"bench: wrote {stem}.md and {stem}.png")


if __name__ == "__main__":
    main()
