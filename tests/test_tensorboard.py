"""TensorBoard content of a 2-rank run, read back with TensorBoard's own reader and served by its own server."""

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import free_port, load_results, run_dirs

TRAIN_TAGS = {"train/loss", "train/lr", "train/samples_per_s", "train/samples_per_s_per_rank", "train/epoch_time_s",
              "perf/data_wait_fraction", "perf/data_wait_fraction_max", "perf/straggler_ratio",
              "perf/compute_s_per_update_min", "perf/compute_s_per_update_median", "perf/compute_s_per_update_max"}
VAL_TAGS = {"val/loss", "val/accuracy"}


@pytest.fixture(scope="module")
def events(ddp_run):
    (run_dir,) = run_dirs(ddp_run[0])
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return accumulator


def test_training_and_validation_scalars(events, ddp_run):
    tags = set(events.Tags()["scalars"])
    assert TRAIN_TAGS | VAL_TAGS <= tags
    loss_steps = [event.step for event in events.Scalars("train/loss")]
    assert loss_steps == sorted(set(loss_steps)) and loss_steps[-1] == 16
    assert [event.step for event in events.Scalars("val/accuracy")] == [8, 16]
    final = load_results(ddp_run[0])
    assert events.Scalars("val/accuracy")[-1].value == pytest.approx(final["val_accuracy"], rel=1e-6)
    for tag in (tag for tag in TRAIN_TAGS if tag.startswith("perf/")):  # at every log step (trainer.log_every_n_steps=2)
        assert [event.step for event in events.Scalars(tag)] == list(range(2, 17, 2)), tag
    for tag in ("perf/data_wait_fraction", "perf/data_wait_fraction_max"):  # a share of the step time
        assert all(0 <= event.value <= 1 for event in events.Scalars(tag)), tag
    assert all(event.value > 0 for event in events.Scalars("perf/compute_s_per_update_min"))  # every rank's compute is timed


def test_a_slow_rank_shows_in_the_straggler_ratio(plain_ddp_run):
    """plain_ddp_run's rank 1 takes 100 ms longer in every forward (fault.slow_rank). Both ranks' steps
    last as long (they wait for each other at the all-reduce), but each rank's own compute doesn't."""
    cwd, _ = plain_ddp_run
    results = load_results(cwd)
    fast, slow = results["compute_s_per_update_per_rank"]
    assert slow >= 0.1 > fast, (fast, slow)
    assert results["straggler_ratio"] == pytest.approx(slow / ((fast + slow) / 2))  # max / median
    (run_dir,) = run_dirs(cwd)
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    ratios = [event.value for event in accumulator.Scalars("perf/straggler_ratio")]
    assert len(ratios) == 4 and all(ratio > 1.3 for ratio in ratios), ratios  # 16 steps, logged every 4
    assert all(event.value >= 0.1 for event in accumulator.Scalars("perf/compute_s_per_update_max"))


def test_the_runs_compute_per_update_leaves_out_the_warm_up_updates_as_samples_per_s_does():
    """ComputeTimer on the host clock, with trainer.warmup_steps=2: the first 2 updates take 100 ms longer (as
    a GPU's first update does, loading libraries and picking kernels). The log window that holds them shows
    them; the run's figure, which results.json reports per rank, is the later updates' alone. A run that is
    all warm-up reports all of it."""
    import torch
    from torch import nn

    from ddp.reporting.meter import ComputeTimer

    def train(updates: int, warmup: int, log_at: set[int]) -> tuple[list[float], float]:
        model = nn.Linear(4, 1)
        timer = ComputeTimer(model, torch.device("cpu"), warmup)
        slow = model.register_forward_hook(lambda *args: time.sleep(0.1))  # inside the timed span: forward to gradient
        windows = []
        for update in range(1, updates + 1):
            model(torch.ones(2, 4)).sum().backward()
            timer.update_done()
            if update == 2:
                slow.remove()
            if update in log_at:
                windows.append(timer.window_per_update())
        return windows, timer.per_update

    windows, run = train(updates=6, warmup=2, log_at={3, 6})
    assert windows[0] >= 0.2 / 3 and run < 0.01, (windows, run)  # broken, the run would read at least 0.2 / 6
    assert train(updates=2, warmup=3, log_at={2})[1] >= 0.1


def test_hparams_are_in_the_run_dir_itself(events, ddp_run):
    """In the run's own event dir (no timestamped subdir), so a sweep's runs form one HParams table."""
    (run_dir,) = run_dirs(ddp_run[0])
    assert [p for p in run_dir.rglob("events.out.tfevents*") if p.parent != run_dir] == []
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["strategy"].string_value == "ddp"
    assert start.hparams["world_size"].number_value == 2
    assert start.hparams["global_batch_size"].number_value == 16
    assert start.hparams["syncbn"].number_value == 1  # torch stores bools as numbers
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} >= {"hparam/val_accuracy", "hparam/val_loss", "hparam/train_loss"}



def test_tensorboard_server_serves_the_run(ddp_run):
    (run_dir,) = run_dirs(ddp_run[0])
    port = free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    server = subprocess.Popen(
        [str(tensorboard), "--logdir", str(run_dir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    query = urllib.parse.urlencode({"run": ".", "tag": "val/accuracy"})
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
    try:
        deadline, points = time.monotonic() + 90, None
        while points is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    points = json.load(response)
            except OSError:
                time.sleep(0.5)
        assert points, "tensorboard did not serve val/accuracy"
        assert points[-1][1] == 16
        assert points[-1][2] == pytest.approx(load_results(ddp_run[0])["val_accuracy"], rel=1e-6)
    finally:
        server.terminate()
        server.wait(timeout=30)
