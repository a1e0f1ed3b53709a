"""`make bench` end to end in its tiny form (BENCH_QUICK=1: the plain loop, DDP and single), so the tool
can't rot; the full bench's commands and ratio rows, checked without running it; and the data-wait
measure it and every run report."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from conftest import REPO, check
from ddp.config.checks import validate
from ddp.config.schema import register_configs
from ddp.reporting.meter import ThroughputMeter


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_bench_writes_the_table_the_ratios_and_a_plot(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--out", str(tmp_path)], cwd=REPO,
                            env=os.environ | {"BENCH_QUICK": "1"}, capture_output=True, text=True,
                            timeout=600)  # a hang's bound: on a loaded 2-core machine it has taken 265 s
    check(result)
    (table,) = tmp_path.glob("*-quick.md")
    (plot,) = tmp_path.glob("*-quick.png")
    text = table.read_text()
    assert text.split("\n\n![")[0] in result.stdout  # printed too
    for contender in ("plain", "ddp", "single"):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| small_cnn | {contender} |")]
        throughput = float(row.split("|")[4].split()[0])
        assert throughput > 0, row
    for ratio in ("train.py DDP / plain loop, throughput, small_cnn", "train.py DDP / plain loop, whole-process wall time",
                  "weak scaling", "per-sample seeding", "resume cost", "input pipeline: local shards, 1 worker / in-memory",
                  "input pipeline: HTTP shards, warm cache, 1 worker / in-memory", "input pipeline: files, 2 workers / 1 worker",
                  "activation_checkpointing=full / none, bytes kept",
                  "detection: train.py / plain loop (references' train_one_epoch), images/s, small_fcos",
                  "detection: train.py / plain loop, peak memory (peak RSS), small_fcos"):
        assert re.search(rf"\| {re.escape(ratio)}[^|]* \| \d+\.\d{{3}} \|", text), ratio
    (row,) = [line for line in text.splitlines() if line.startswith("| fsdp async | ")]  # memory and scale, quick: one run
    assert float(row.split("|")[2]) > 0 and float(row.split("|")[3]) > 0, row
    if load_bench().LIGHTNING:  # the optional extra (.[bench]): its contender, or a line that says it was skipped
        assert re.search(r"\| train.py DDP / Lightning, throughput, small_cnn \| \d+\.\d{3} \|", text), text
    else:
        assert "Lightning rows skipped: Lightning is not installed" in text, text
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.width > 100


def test_every_contender_of_the_full_bench_composes_and_its_ratios_come_out():
    """`make bench` takes about an hour, so no test runs it whole: each train.py command it would run (syncbn=true,
    bf16, channels_last, dp and fsdp too, the memory-and-scale section's ViT under ddp, fsdp and hsdp on 4
    processes, and the detection section's detectors) composes and passes train.py's checks, and its report, from made-up
    measurements, has every ratio row with the ratio of those numbers (syncbn's: ddp's throughput over ddp
    syncbn's)."""
    bench = load_bench()
    bench.LIGHTNING = True  # its rows, whether or not the optional extra is installed here
    chosen = bench.contenders(bench.FULL, quick=False)
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for contender in (c for c in chosen if c.name not in bench.SCRIPTS):
            argv = bench.command(contender, bench.FULL, Path("run"))
            overrides = [arg for arg in argv[argv.index(str(REPO / "train.py")) + 1:] if not arg.startswith("hydra.")]
            validate(compose("config", overrides=overrides), launched=contender.processes > 1, world_size=contender.processes)
        scale = bench.memory_scale.SCALE_FULL
        for strategy in scale.strategies:  # the memory-and-scale section's runs, on 4 processes
            argv = bench.memory_scale.command(strategy, scale, Path("run"))
            overrides = [arg for arg in argv[argv.index(str(REPO / "train.py")) + 1:] if not arg.startswith("hydra.")]
            validate(compose("config", overrides=overrides), launched=True, world_size=scale.processes)
        detection = bench.detection.DETECTION_FULL
        for model in detection.models:  # the detection section's train.py runs, one process each
            argv = bench.detection.command("train.py", model, detection, Path("run"))
            overrides = [arg for arg in argv[argv.index(str(REPO / "train.py")) + 1:] if not arg.startswith("hydra.")]
            validate(compose("config", overrides=overrides), launched=False, world_size=1)
    for contender in (c for c in chosen if c.model == "tiny_cnn"):  # steps of milliseconds: 300 timed, every contender
        argv = bench.command(contender, bench.FULL, Path("run"))
        samples = next((int(arg.split("=")[1]) for arg in argv if arg.startswith("data.num_samples=")), None)
        timed = int(argv[argv.index("--steps") + 1]) if samples is None else samples // (2 * bench.FULL.batch_size) - bench.FULL.warmup
        assert timed == 300, (contender.name, argv)
    for index, contender in enumerate(chosen):  # distinct throughputs: 100, 110, 120, ...; bytes 1000, 1100, ...
        contender.throughput, contender.wall, contender.state_bytes = [100.0 + 10 * index], [10.0 + index], [1000 + 100 * index]
    found = {(c.name, c.model): c for c in chosen}
    seeding, resumes = {"seeded": [98.0], "unseeded": [100.0]}, {"10%": [10.0], "90%": [10.5]}
    names = [bench.data_path.pipeline_name(*contender) for contender in bench.data_path.PIPELINE]
    pipeline = {name: [(190.0 - 10 * index, 200.0 + index)] for index, name in enumerate(names)}  # (rate, the limit's next to it)
    table = bench.report(chosen, bench.FULL, False, *bench.data_path.report(seeding, resumes, pipeline, bench.data_path.DATA_FULL))
    rows = dict(re.findall(r"^\| ([^|]+) \| (-?\d+\.\d{3}) \|", table, re.M))

    def throughput(name, model):
        return found[name, model].throughput[0]

    for name, what in (("ddp", "train.py DDP"), ("ddp malloc default", "train.py DDP, keep_freed_host_memory=false")):
        assert float(rows[f"{what} - plain loop, time per step (ms), tiny_cnn"]) == pytest.approx(
            1000 * 2 * bench.FULL.batch_size * (1 / throughput(name, "tiny_cnn") - 1 / throughput("plain", "tiny_cnn")), abs=5e-4)
    for model in ("tiny_cnn", "small_cnn", "resnet18"):
        assert float(rows[f"train.py DDP / Lightning, throughput, {model}"]) == pytest.approx(
            throughput("ddp", model) / throughput("lightning", model), abs=5e-4)
        # the loop's own cost with the plain loop's allocator, and what keeping freed memory gives
        assert float(rows[f"train.py DDP, keep_freed_host_memory=false / plain loop, throughput, {model}"]) == pytest.approx(
            throughput("ddp malloc default", model) / throughput("plain", model), abs=5e-4)
        assert float(rows[f"keep_freed_host_memory=true / false, throughput, {model}, 2 ranks"]) == pytest.approx(
            throughput("ddp", model) / throughput("ddp malloc default", model), abs=5e-4)
    for model in ("small_cnn", "resnet18"):
        expected = {
            f"train.py DDP / plain loop, throughput, {model}": throughput("ddp", model) / throughput("plain", model),
            f"syncbn=true / syncbn=false, step time, {model}, 2 ranks": throughput("ddp", model) / throughput("ddp syncbn", model),
            f"weak scaling: per-rank throughput, 2 ranks / 1 rank, {model}": throughput("ddp", model) / 2 / throughput("single", model),
            f"bf16 / fp32, throughput, {model}, 2 ranks": throughput("ddp bf16", model) / throughput("ddp", model),
            f"channels_last / NCHW, throughput, {model}, 2 ranks": throughput("ddp channels_last", model) / throughput("ddp", model),
            f"fsdp / ddp, throughput, {model}, 2 ranks": throughput("fsdp", model) / throughput("ddp", model),
            f"fsdp / ddp, rank 0's bytes of parameters, gradients and optimizer state, {model}, 2 ranks":
                found["fsdp", model].state_bytes[0] / found["ddp", model].state_bytes[0],
        }
        for what, ratio in expected.items():
            assert float(rows[what]) == pytest.approx(ratio, abs=5e-4), what
    for model in ("small_cnn", "resnet18"):
        wall = found["ddp", model].wall[0] / found["plain", model].wall[0]
        assert float(rows[f"train.py DDP / plain loop, whole-process wall time, {model}"]) == pytest.approx(wall, abs=5e-4)
    for tracker in ("mlflow", "wandb"):  # the trackers' cost, against TensorBoard alone
        with_it, ddp = found[f"ddp +{tracker}", "small_cnn"], found["ddp", "small_cnn"]
        what = f"logger=[tensorboard,{tracker}] / tensorboard, %s, small_cnn, 2 ranks"
        assert float(rows[what % "throughput"]) == pytest.approx(with_it.throughput[0] / ddp.throughput[0], abs=5e-4)
        assert float(rows[what % "whole-process wall time"]) == pytest.approx(with_it.wall[0] / ddp.wall[0], abs=5e-4)
    assert float(rows["logger=[tensorboard,mlflow] / tensorboard, whole-process wall time, small_cnn, 1 process, a core to spare"]
                 ) == pytest.approx(found["single +mlflow", "small_cnn"].wall[0] / found["single", "small_cnn"].wall[0], abs=5e-4)
    assert float(rows["per-sample seeding: loader images/s, seeded / unseeded"]) == pytest.approx(0.98, abs=5e-4)
    assert float(rows["resume cost: launch to first update, 90% / 10% into an epoch"]) == pytest.approx(1.05, abs=5e-4)
    for name in ("local shards, 1 worker", "HTTP shards, warm cache, 1 worker"):
        (rate, limit), = pipeline[name]
        assert float(rows[f"input pipeline: {name} / in-memory decode limit"]) == pytest.approx(rate / limit, abs=5e-4)
    assert float(rows["input pipeline: files, 2 workers / 1 worker"]) == pytest.approx(
        pipeline["files, 2 workers"][0][0] / pipeline["files, 1 worker"][0][0], abs=5e-4)
    # memory and scale: made-up runs (state MB, a save's time) and activation figures (bytes, step time)
    runs = {strategy: [{"state_mb": 100.0 - 20 * index, "blocked_s": 2.0 - 0.5 * index, "checkpoint_mb": 264.0}]
            for index, strategy in enumerate(bench.memory_scale.SCALE_FULL.strategies)}
    activations = {"none": (1000, 1.0), "selective": (500, 1.2), "full": (100, 1.3)}
    lines, scale_rows = bench.memory_scale.report(runs, activations, bench.memory_scale.SCALE_FULL)
    scale_rows = {what: ratio for what, ratio, _ in scale_rows}
    assert scale_rows["fsdp / ddp, rank 0's bytes of parameters, gradients and optimizer state, vit, 4 ranks"] == pytest.approx(0.8)
    assert scale_rows["hsdp / ddp, rank 0's bytes of parameters, gradients and optimizer state, vit, 4 ranks"] == pytest.approx(0.6)
    assert scale_rows["async / sync save, the loop's time in a save, vit fsdp, 4 ranks"] == pytest.approx(0.5 / 1.5)
    assert scale_rows["activation_checkpointing=full / none, bytes kept for the backward, vit"] == pytest.approx(0.1)
    assert scale_rows["activation_checkpointing=full / none, step time, vit, 1 thread"] == pytest.approx(1.3)
    assert "| hsdp | 60.0 | 1.000 | 264 |" in lines
    # detection: made-up runs (images/s, peak MB) of the plain loop and train.py, 3 repeats; a ratio is the median of
    # the repeats' own ratios (0.9, 1.1, 1.1: 1.1), not the ratio of the medians (45 / 50)
    made_up = {"plain loop": [(50.0, 700.0), (100.0, 800.0), (40.0, 700.0)], "train.py": [(45.0, 700.0), (110.0, 808.0), (44.0, 707.0)]}
    runs = {(model, name): [{"samples_per_s": speed, "peak_memory_mb": memory, "wall_s": 10.0} for speed, memory in made_up[name]]
            for model in bench.detection.DETECTION_FULL.models for name in bench.detection.CONTENDERS}
    _, detection_rows = bench.detection.report(runs, bench.detection.DETECTION_FULL)
    detection_rows = {what: ratio for what, ratio, _ in detection_rows}
    for model in bench.detection.DETECTION_FULL.models:
        assert detection_rows[f"detection: train.py / plain loop (references' train_one_epoch), images/s, {model}"] == pytest.approx(1.1)
        assert detection_rows[f"detection: train.py / plain loop, peak memory (peak RSS), {model}"] == pytest.approx(1.01)


def test_time_spent_waiting_for_batches_is_the_data_wait():
    """A loader that takes 20 ms per batch against steps that take none: nearly all the time is data
    wait; the warm-up step is left out, as from samples/s."""
    def slow_batches():
        for index in range(6):
            time.sleep(0.02)
            yield index

    meter = ThroughputMeter(warmup_steps=1, device=torch.device("cpu"))
    meter.resume()
    for _ in meter.timed(slow_batches()):
        meter.step(8)
    meter.pause()
    assert meter.samples == 5 * 8
    assert 0.5 < meter.data_wait_fraction <= 1
    assert meter.window_data_wait() == pytest.approx(meter.data_wait_fraction)
    assert meter.window_data_wait() == 0.0  # nothing timed since
