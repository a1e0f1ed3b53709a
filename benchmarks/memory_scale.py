"""make bench's memory-and-scale section, on a ViT (timm's vit_small_patch16_224 at 32 px in patches of 8: 22M
parameters, 17 tokens):

- each rank's bytes of parameters, gradients and AdamW state (results.json) under ddp, fsdp and hsdp (2 groups of
  2), 4 processes;
- the loop's time in a save (results.json's checkpoint_blocked_s, the median over the run's saves: fsdp's every 4
  updates and at the end, the others' at the end), checkpoint.async_save=false against true under fsdp;
- in this process (one thread): the bytes autograd keeps for the backward of one step (the parameters, kept
  anyway, left out) and the step's time, with activation_checkpointing none, selective (every 2nd block) and full.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ScaleSettings:
    vit: dict  # timm.create_model's arguments beyond vit_small_patch16_224's
    processes: int
    steps: int  # one epoch of this many updates
    every_n_steps: int  # sharded saves
    repeats: int
    batch_size: int = 8
    image_size: int = 32
    strategies: tuple[str, ...] = ("ddp", "fsdp", "hsdp", "fsdp async")


SCALE_FULL = ScaleSettings(vit={"img_size": 32, "patch_size": 8}, processes=4, steps=12, every_n_steps=4, repeats=2)
SCALE_QUICK = ScaleSettings(vit={"img_size": 16, "patch_size": 8, "depth": 2, "embed_dim": 64, "num_heads": 2}, processes=2,
                            steps=4, every_n_steps=2, repeats=1, image_size=16, strategies=("fsdp async",))
STRATEGIES = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"], "hsdp": ["strategy=hsdp", "strategy.shard_size=2"],
              "fsdp async": ["strategy=fsdp", "checkpoint.async_save=true"]}


def command(strategy: str, settings: ScaleSettings, run_dir: Path) -> list[str]:
    samples = settings.steps * settings.batch_size * settings.processes
    vit = [f"+model.kwargs.{key}={value}" for key, value in settings.vit.items()]
    return [str(TORCHRUN), "--standalone", f"--nproc_per_node={settings.processes}", str(REPO / "train.py"),
            *STRATEGIES[strategy], "model=timm", "model.name=vit_small_patch16_224", *vit, "data=synthetic",
            f"data.num_samples={samples}", f"data.num_val_samples={settings.batch_size}", f"data.image_size={settings.image_size}",
            f"data.batch_size={settings.batch_size}", "optim=adamw", "trainer.max_epochs=1", "checkpoint.keep_best=0",
            f"checkpoint.every_n_steps={settings.every_n_steps if 'fsdp' in strategy else 0}", f"hydra.run.dir={run_dir}"]


def scale_runs(settings: ScaleSettings, scratch: Path) -> dict[str, list[dict]]:
    """Each strategy's train.py runs, interleaved, `repeats` times: {strategy: [{state_mb, blocked_s, checkpoint_mb}]}."""
    found: dict[str, list[dict]] = {strategy: [] for strategy in settings.strategies}
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    for repeat in range(settings.repeats):
        for strategy in settings.strategies:
            print(f"bench: memory and scale, repeat {repeat + 1}/{settings.repeats}: vit {strategy} x{settings.processes}", flush=True)
            run_dir = scratch / f"scale{len(list(scratch.glob('scale*')))}"
            result = subprocess.run(command(strategy, settings, run_dir), cwd=scratch, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"bench: vit {strategy} failed:\n{result.stderr[-3000:]}")
            results = json.loads((run_dir / "results.json").read_text())
            steps = sorted((run_dir / "checkpoints").glob("step-*"))
            found[strategy].append({
                "state_mb": sum(results[f"{kind}_bytes_per_rank"][0] for kind in ("parameter", "gradient", "optimizer_state")) / 2**20,
                "blocked_s": statistics.median(results["checkpoint_blocked_s"]) if results["checkpoint_blocked_s"] else None,
                "checkpoint_mb": size_mb(steps[-1]) if steps else None,
            })
    return found


def size_mb(checkpoint: Path) -> float:
    """A checkpoint file's size, or a sharded checkpoint dir's files' together."""
    files = [checkpoint] if checkpoint.is_file() else [path for path in checkpoint.rglob("*") if path.is_file()]
    return sum(path.stat().st_size for path in files) / 2**20


def activation_memory(settings: ScaleSettings, steps: int = 5) -> dict[str, tuple[int, float]]:
    """{mode: (bytes kept for the backward, the median step time in s)} of the ViT in this process, one thread, its
    malloc keeping freed memory as train.py's ranks do (keep_freed_host_memory): glibc's default would fault the
    activations' pages in again every step, which costs `none` the most."""
    import timm

    from ddp.distributed.env import keep_freed_host_memory
    from ddp.training.activation_checkpointing import bytes_saved_for_backward, checkpoint_activations

    keep_freed_host_memory()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    found = {}
    try:
        for mode in MODES:
            torch.manual_seed(0)
            model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10, **settings.vit)
            checkpoint_activations(model, None, mode, every=2)
            images = torch.randn(settings.batch_size, 3, settings.image_size, settings.image_size)
            kept, output = bytes_saved_for_backward(lambda: model(images))
            output.sum().backward()
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                model(images).sum().backward()
                times.append(time.perf_counter() - started)
            found[mode] = (kept, statistics.median(times))
    finally:
        torch.set_num_threads(threads)
    return found


def report(runs: dict[str, list[dict]], activations: dict[str, tuple[int, float]], settings: ScaleSettings) -> tuple[list[str], list[tuple]]:
    """The section's table lines and its ratio rows (what, ratio, goal)."""
    def median_of(strategy: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[strategy])

    lines = ["", f"Memory and scale: timm vit_small_patch16_224 {settings.vit}, batch {settings.batch_size} per process, AdamW, "
             f"{settings.processes} processes, {settings.steps} updates, {settings.repeats} repeats (median).", "",
             "| strategy | rank 0's parameters + gradients + optimizer state, MB | a save's time in the loop, s | checkpoint, MB |",
             "|---|---|---|---|"]
    for strategy, found in runs.items():
        blocked = median_of(strategy, "blocked_s") if found[0]["blocked_s"] is not None else None
        size = found[0]["checkpoint_mb"]
        lines.append(f"| {strategy} | {median_of(strategy, 'state_mb'):.1f} | {'-' if blocked is None else f'{blocked:.3f}'} | "
                     f"{'-' if size is None else f'{size:.0f}'} |")
    lines += ["", "| activation_checkpointing | bytes kept for the backward, MB | step time, s |", "|---|---|---|"]
    lines += [f"| {mode} | {kept / 2**20:.2f} | {seconds:.3f} |" for mode, (kept, seconds) in activations.items()]
    rows = []
    for strategy, goal in (("fsdp", "<= 0.27"), ("hsdp", "<= 0.52")):
        if strategy in runs and "ddp" in runs:
            rows.append((f"{strategy} / ddp, rank 0's bytes of parameters, gradients and optimizer state, vit, "
                         f"{settings.processes} ranks", median_of(strategy, "state_mb") / median_of("ddp", "state_mb"), goal))
    if "fsdp" in runs and "fsdp async" in runs:
        rows.append((f"async / sync save, the loop's time in a save, vit fsdp, {settings.processes} ranks",
                     median_of("fsdp async", "blocked_s") / median_of("fsdp", "blocked_s"), "<= 0.25"))
    none_bytes, none_time = activations["none"]
    for mode, goal in (("selective", "for the record"), ("full", "<= 0.25")):
        rows.append((f"activation_checkpointing={mode} / none, bytes kept for the backward, vit", activations[mode][0] / none_bytes, goal))
    for mode, goal in (("selective", "for the record"), ("full", "<= 1.40")):
        rows.append((f"activation_checkpointing={mode} / none, step time, vit, 1 thread", activations[mode][1] / none_time, goal))
    return lines, rows
