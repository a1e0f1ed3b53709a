"""What the trainer's knobs and measurements promise, checked on real single-process runs (train.run
in the test process where the property is the training's, train.py launched where it is the
launch's): batch limits, validation cadence, checkpoint pruning, resuming a run dir, the
steady-state throughput window, per-run peak memory, and real training of resnet18 and of an ImageFolder."""

import concurrent.futures
import gc
import json
import logging
import runpy
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, check, job_dir, last_checkpoint, launch, results_of, run_in_this_process, shared_run, write_imagefolder
from models.resnet import build_resnet18

# 4 epochs of 3 batches (limit_train_batches), validation on 2 batches of 8 after epochs 3 and 4,
# a checkpoint every 2 steps of which 2 are kept, every step in the warm-up, and the LR scaled by
# sqrt(global batch 8 / 32). No best checkpoints: the step files are keep_last's alone.
KNOBS = ["strategy=single", "syncbn=true", *TINY, "trainer.max_epochs=4", "trainer.limit_train_batches=3",
         "trainer.limit_val_batches=2", "trainer.val_every_n_epochs=3", "trainer.log_every_n_steps=1",
         "trainer.warmup_steps=12", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "optim.lr_scaling=sqrt",
         "optim.reference_batch_size=32", "checkpoint.keep_best=0"]  # keep_best: tests/test_best.py


def scalars(run_dir, tag: str) -> list:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return accumulator.Scalars(tag)


@pytest.fixture(scope="module")
def knobs_run(tmp_path_factory):
    """KNOBS by train.run in this process (what is checked is the training's; resuming its run dir
    through a launch: below): (run dir, its log records' text)."""
    run_dir = tmp_path_factory.mktemp("knobs") / "run"
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(run_dir.parent)
            run_in_this_process(KNOBS, run_dir)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return run_dir, "\n".join(records)


def test_batch_limits_and_validation_cadence(knobs_run):
    run_dir, _ = knobs_run
    results = results_of(run_dir)
    assert (results["steps"], results["epochs"]) == (12, 4)
    assert results["val_samples"] == 16  # 2 batches of 8: limit_val_batches
    assert [e.step for e in scalars(run_dir, "train/loss")] == list(range(1, 13))
    assert [e.step for e in scalars(run_dir, "val/loss")] == [9, 12]  # after epoch 3, and always after the last


def test_keep_last_prunes_older_step_checkpoints(knobs_run):
    run_dir, _ = knobs_run
    directory = run_dir / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000010.pt", "step-00000012.pt"]
    assert torch.load(directory / "last.pt", weights_only=True)["global_step"] == 12


def test_warmup_steps_are_left_out_of_samples_per_s(knobs_run):
    """All 12 steps are warm-up: no steady-state throughput to report, rather than a made-up one."""
    results = results_of(knobs_run[0])
    assert results["samples_per_s"] is None


def test_lr_scaling_sets_the_lr_that_is_used_logged_and_reported(knobs_run):
    run_dir, log = knobs_run
    assert results_of(run_dir)["lr"] == pytest.approx(0.025)  # 0.05 * sqrt(8 / 32)
    assert " lr=0.025 " in log
    assert [e.value for e in scalars(run_dir, "train/lr")] == pytest.approx([0.025] * 12)
    assert last_checkpoint(run_dir)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.025)


def test_syncbn_with_one_process_warns_that_it_changes_nothing(knobs_run):
    _, log = knobs_run
    assert "syncbn=true has no effect with strategy=single: one process, so BatchNorm already sees the whole batch" in log


def test_resume_of_a_run_dir_continues_in_that_dir(knobs_run, tmp_path):
    source = tmp_path / "run"
    shutil.copytree(knobs_run[0], source)
    result = launch([*KNOBS, "trainer.max_epochs=5", f"resume={source}"], tmp_path)
    check(result)
    assert f"resumed from {source / 'checkpoints' / 'last.pt'} at epoch 4, batch 0, step 12" in result.stdout
    assert not (tmp_path / "outputs").exists()  # no new run dir
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == ["last.pt", "step-00000014.pt", "step-00000015.pt"]
    results = json.loads((source / "results.json").read_text())
    assert (results["steps"], results["epochs"]) == (15, 5)
    assert [e.step for e in scalars(source, "train/loss")] == list(range(1, 16))


def test_samples_per_s_counts_training_steps_only(tmp_path, monkeypatch):
    """Validation here costs more than training (8x the samples). samples_per_s must still be the
    training rate, which TensorBoard's own timestamps of the per-step losses measure independently:
    samples between two steps of one epoch over the wall time between them. Tolerance: 25%.
    (train.run in this process: a launch costs seconds of start-up, outside what is measured.)"""
    args = ["strategy=single", *TINY, "data.num_samples=512", "data.num_val_samples=4096", "trainer.log_every_n_steps=1",
            "trainer.warmup_steps=5"]
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_in_this_process(args, run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    wall_time = {e.step: e.wall_time for e in scalars(run_dir, "train/loss")}
    assert sorted(wall_time) == list(range(1, 129))
    spans = [(5, 64), (65, 128)]  # within epoch 0 after warm-up, and within epoch 1
    samples = sum(last - first for first, last in spans) * 8
    seconds = sum(wall_time[last] - wall_time[first] for first, last in spans)
    assert results["samples_per_s"] == pytest.approx(samples / seconds, rel=0.25)
    assert results["train_time_s"] < results["wall_s"]


def test_a_training_step_reuses_the_memory_the_step_before_it_freed(tmp_path):
    """glibc's malloc gives back to the system what a training step frees (over 64 MiB here: small_cnn at 32 px, batch 32),
    and the next step faults it in again, a page fault per 4 KiB. With keep_freed_host_memory (the default) the process
    keeps it: past the first steps a whole step (forward, backward, optimizer, the next batch) takes, at the median, under
    1% of the faults it takes with glibc's behaviour, which keep_freed_host_memory=false and malloc's own variables, where the
    user set them (MALLOC_TRIM_THRESHOLD_ at glibc's default), leave as they are. Launched: the setting is the process's."""
    args = ["model._target_=tests.workers.step_faults.StepFaults", "data=synthetic", "data.num_samples=640", "data.num_val_samples=32",
            "data.image_size=32", "data.batch_size=32", "trainer.max_epochs=1"]
    runs = {"kept": ([], {}), "off": (["keep_freed_host_memory=false"], {}), "users": ([], {"MALLOC_TRIM_THRESHOLD_": "131072"})}
    for name in runs:
        (tmp_path / name).mkdir()
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:  # at once: a step's faults don't depend on the timing
        done = [pool.submit(launch, [*args, f"+model.record={tmp_path / name}.txt", *extra], tmp_path / name, env=env)
                for name, (extra, env) in runs.items()]
    for result in done:
        check(result.result())

    def faults_per_step(name: str) -> list[int]:
        counts = [int(line) for line in (tmp_path / f"{name}.txt").read_text().split()]
        assert len(counts) == 20  # 20 training steps
        return [after - before for before, after in zip(counts[3:], counts[4:])]  # steps 4 to 19

    kept = faults_per_step("kept")  # a step may still grow the heap (by 16 MiB, up to 5 times in 30 steps on a loaded machine)
    for name in ("off", "users"):
        assert statistics.median(kept) * 100 < statistics.median(faults_per_step(name)), (kept, name, faults_per_step(name))


@pytest.mark.parametrize("launcher", ["torchrun", "self-launched"])
def test_a_ranks_imports_stay_out_of_the_garbage_collectors_scans_while_it_trains(launcher, tmp_path, monkeypatch):
    """A rank's imports (torch, Hydra) make hundreds of thousands of objects that live as long as the process; the
    collector, off for them, is on while the rank trains (its cyclic garbage is freed) and leaves them out of its scans
    (gc.freeze): those would take 0.2 s each, and 0.7 s at the exit. 2 ranks, under torchrun and spawned by train.py's
    own launcher (which imports train.py as __mp_main__). A process that imports
    train.py, or runs it as __main__ with torch imported already (this one: a notebook's %run, a test), keeps its
    collector as it was, also where the run ends before it starts (--help)."""
    record = tmp_path / "collector.txt"
    args = ["strategy=ddp", "model._target_=tests.workers.collector_state.CollectorState", f"+model.record={record}",
            *TINY, "trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    check(launch(args, tmp_path, nproc=2) if launcher == "torchrun" else launch([*args, "strategy.nproc_per_node=2"], tmp_path))
    states = [line.split() for line in record.read_text().splitlines()]
    assert len(states) == 4  # 2 steps on each rank
    assert all(enabled == "1" and int(frozen) > 100_000 for enabled, frozen in states), states
    import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(Path(train.__file__)), run_name="__main__")
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.fixture(scope="module")
def big_then_resnet18(tmp_path_factory) -> tuple[dict, Path]:
    """One multirun of resnet18 on 32x32 synthetic images, 4 training batches and 12 val samples:
    job 0 generates 20,000 images (about 600 MB), job 1 only 32 (4 batches: one epoch).
    Once for all test processes (shared_run). (job 0's results.json, job 1's dir)."""
    tiny = [arg for arg in TINY if not arg.startswith(("model.", "data.num_samples", "data.num_val_samples", "data.image_size"))]
    args = ["-m", "strategy=single", "model=resnet18", *tiny, "data.image_size=32", "data.num_val_samples=12",
            "trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.num_samples=20000,32"]
    cwd, _ = shared_run("big_then_resnet18", lambda cwd: check(launch(args, cwd)), tmp_path_factory)
    (sweep,) = (cwd / "outputs" / "multirun").iterdir()
    return json.loads((job_dir(sweep, 0) / "results.json").read_text()), job_dir(sweep, 1)


def test_peak_memory_is_measured_per_run_in_a_multirun(big_then_resnet18):
    """A multirun runs its jobs in one process: job 1 (tiny data) must not report job 0's peak
    (about 600 MB more, for 20,000 generated 32x32 images)."""
    big, small_dir = big_then_resnet18
    small = json.loads((small_dir / "results.json").read_text())
    assert big["peak_memory_device"] == small["peak_memory_device"] == "cpu"
    assert small["peak_memory_mb"] < big["peak_memory_mb"] - 400, (big["peak_memory_mb"], small["peak_memory_mb"])


def test_resnet18_trains_end_to_end(big_then_resnet18):
    """The multirun's job 1: resnet18 through a whole (one-epoch) run, its checkpoint loading strictly."""
    _, run_dir = big_then_resnet18
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["steps"], results["val_samples"]) == (4, 12)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    build_resnet18(num_classes=10, in_channels=3, small_input=True).load_state_dict(checkpoint["model"], strict=True)


def test_imagefolder_trains_a_pretrained_torchvision_model_and_evaluates_its_test_split(tmp_path, monkeypatch, caplog):
    """A real folder of PNGs (3 classes x 8 training images) with TrivialAugment; resnet18 by name from
    local ImageNet-shaped weights, its 1000-class head skipped; then mode=eval on the folder's test/
    split. In the main process: ImageFolders read by loader workers train in test_models_and_data.py
    and test_recipes.py. The training is train.run in this process (a launch costs seconds of start-up),
    the evaluation a launched multirun."""
    root = write_imagefolder(tmp_path / "images", classes=("cat", "dog", "eel"), per_class={"train": 8, "val": 4, "test": 5},
                             splits=("train", "val", "test"))
    torch.manual_seed(0)  # the same stand-in weights every run
    weights = torchvision.models.resnet18(num_classes=1000).state_dict()
    # values no fresh initialisation has: BatchNorm counts of 1000 batches seen (fresh: 0), a stem scale of 5 (fresh: 1)
    for key in (key for key in weights if key.endswith("num_batches_tracked")):
        weights[key].fill_(1000)
    weights["bn1.weight"].fill_(5.0)
    torch.save(weights, tmp_path / "resnet18_imagenet.pth")
    data = ["data=imagefolder", f"data.root={root}", "data.image_size=32", "data.batch_size=4", "data.num_workers=0"]
    (tmp_path / "eval").mkdir()
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "train" / "run"
    with caplog.at_level(logging.INFO):
        run_in_this_process([*data, "data.augment=trivialaugment", "model=torchvision", "model.name=resnet18",
                             f"model.weights_path={tmp_path / 'resnet18_imagenet.pth'}", "trainer.max_epochs=2", "optim.lr=0.001"], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["steps"], results["val_samples"]) == (12, 12)  # 24 images: 6 batches of 4, 2 epochs
    assert "skipped the classifier head ['fc.bias', 'fc.weight']" in caplog.text
    trained = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert trained["fc.weight"].shape == (3, 512)  # one output per class folder
    # loaded, then trained: every BatchNorm counted the 12 training batches on top of the file's 1000
    assert {trained[key].item() for key in trained if key.endswith("num_batches_tracked")} == {1012}
    assert torch.allclose(trained["bn1.weight"], weights["bn1.weight"], atol=0.5)
    assert not torch.equal(trained["bn1.weight"], weights["bn1.weight"])

    # one multirun evaluates the checkpoint on test/, and on val/: there, the run's own final val metrics
    check(launch(["-m", *data, "mode=eval", f"resume={run_dir}", "data.split=test,val"], tmp_path / "eval"))
    (sweep,) = (tmp_path / "eval" / "outputs" / "multirun").iterdir()
    on_test, on_val = (json.loads((job_dir(sweep, job) / "eval.json").read_text()) for job in (0, 1))
    assert (on_test["split"], on_test["test_samples"], on_test["step"]) == ("test", 15, 12)
    assert (on_val["split"], on_val["val_samples"], on_val["val_accuracy"]) == ("val", 12, results["val_accuracy"])
    assert on_val["val_loss"] == pytest.approx(results["val_loss"], rel=1e-6)
    for job in (0, 1):  # an evaluation saves nothing
        assert not list(job_dir(sweep, job).rglob("*.pt")) and not list(job_dir(sweep, job).rglob("events.out.tfevents*"))
