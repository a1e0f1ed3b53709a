"""Keeping the best checkpoint, reporting the best validation, and stopping early (checkpoint.keep_best,
trainer.objective, trainer.early_stop_patience), on real runs of train.py: one process, and 2 DDP
ranks under torchrun (CPU, gloo)."""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from conftest import (REPO, check, checked_launch, completed_process, launch, results_of, run_dirs, run_in_this_process,
                      shared_run, shared_run_in_this_process)
from ddp.config.schema import ConfigError
from test_fault_tolerance import assert_bit_identical, assert_same_state

# Synthetic labels are random: a high LR memorises them and the val loss rises after the second
# epoch, so the best validation is not the last. The task ranks by val loss, lower is better.
# 8 steps per epoch; val losses at steps 8, 16, 24, 32: 2.475, 2.425 (the best), 3.123, 3.180.
# A checkpoint every 5 steps, of which keep_last=1 is kept: pruning goes past both best steps.
BEST = ["strategy=single", "data=synthetic", "data.num_samples=64", "data.num_val_samples=37", "data.image_size=8",
        "data.batch_size=8", "model.channels=[8,16]", "optim.lr=0.5", "task.objective=val_loss", "task.direction=minimize",
        "trainer.max_epochs=4", "trainer.log_every_n_steps=4", "checkpoint.every_n_steps=5", "checkpoint.keep_last=1",
        "checkpoint.keep_best=2"]
# 2 ranks of 4 batches per epoch; val losses 2.383 (step 4), 2.516, 2.725: patience 2 stops at step 12 of 40.
# A rank that went on alone would wait in its next collective: strategy.timeout_s ends that job soon.
EARLY = ["strategy=ddp", *BEST[1:], "trainer.max_epochs=10", "checkpoint.every_n_steps=0", "trainer.early_stop_patience=2",
         "strategy.timeout_s=30"]
# BEST with EMA weights beside the model (decay 0.9 per update), ranked by the model's validation (best_run,
# as above) and by the EMA weights' (ema_run): one multirun trains both. The EMA weights' val losses, 2.333
# (step 8, the best), 2.368, 2.406, 2.544, rank step 8 first, while the raw model's make step 16 the best.
RANKED_BY = {best_of: [*BEST, "ema.decay=0.9", f"checkpoint.best_of={best_of}"] for best_of in ("model", "ema")}


def the_run_dir(cwd: Path) -> Path:
    (run_dir,) = run_dirs(cwd)
    return run_dir


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@pytest.fixture(scope="module")
def ranked_runs(tmp_path_factory) -> dict[str, Path]:
    """RANKED_BY's runs, by train.run in a test process (a launch costs seconds of start-up; a sweep
    that ranks its jobs: below), once for all of them (shared_run): {best_of: run dir}."""
    runs = {best_of: shared_run_in_this_process(f"best_ranked_by_{best_of}", overrides, tmp_path_factory)
            for best_of, overrides in RANKED_BY.items()}
    assert all(load(run_dir / "checkpoints" / "last.pt")["config"]["checkpoint"]["best_of"] == best_of
               for best_of, run_dir in runs.items())
    return runs


@pytest.fixture(scope="module")
def best_run(ranked_runs) -> Path:
    return ranked_runs["model"]


@pytest.fixture(scope="module")
def ema_run(ranked_runs) -> Path:
    return ranked_runs["ema"]


@pytest.fixture(scope="module")
def best_evaluated(ranked_runs, tmp_path_factory) -> dict[str, dict]:
    """mode=eval of each ranked run's best.pt on BEST's data, by train.run in this process (a launch costs
    seconds of start-up; mode=eval launched: tests/test_trainer.py), once for all test processes
    (shared_run): {best_of: its eval.json}."""
    def produce(cwd: Path) -> dict[str, dict]:
        evaluations = {}
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            for best_of in ("model", "ema"):
                checkpoint = ranked_runs[best_of] / "checkpoints" / "best.pt"
                run_in_this_process(["mode=eval", f"resume='{checkpoint}'", *BEST[1:6]], cwd / best_of)
                evaluations[best_of] = json.loads((cwd / best_of / "eval.json").read_text())
        return evaluations

    return shared_run("best_evaluated", produce, tmp_path_factory)[1]


def test_best_pt_holds_the_best_validation_and_evaluates_to_it_exactly(best_run, best_evaluated):
    results = results_of(best_run)
    losses = scalars(best_run, "val/loss")
    assert [step for step, _ in losses] == [8, 16, 24, 32]
    best_step = min(losses, key=lambda logged: logged[1])[0]
    assert (results["best_step"], results["best_epoch"], results["steps"]) == (best_step, 1, 32) == (16, 1, 32)
    assert results["best_val_loss"] < results["val_loss"]  # the last validation is worse: best.pt is not last.pt
    assert results["best_val_loss"] == pytest.approx(dict(losses)[best_step], rel=1e-6)  # TensorBoard keeps float32
    # val/best_loss: the best so far at every validation
    running = [min(value for _, value in losses[:index + 1]) for index in range(len(losses))]
    assert [value for _, value in scalars(best_run, "val/best_loss")] == pytest.approx(running, rel=1e-6)

    best = load(best_run / "checkpoints" / "best.pt")
    assert best["global_step"] == 16 and best["best"]["best"]["step"] == 16
    evaluation = best_evaluated["model"]
    assert evaluation["step"] == 16
    for key in ("val_loss", "val_accuracy"):
        assert evaluation[key] == results[f"best_{key}"], key  # exactly: the same model, the same exact evaluation


def test_keep_last_pruning_leaves_the_best_checkpoints(best_run):
    """keep_last=1 prunes every step file but the last; best-8 and best-16 (the 2 best) stay, best.pt is best-16."""
    directory = best_run / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == [
        "best-00000008.pt", "best-00000016.pt", "best.pt", "last.pt", "step-00000032.pt"]
    assert [load(directory / name)["global_step"] for name in ("best-00000008.pt", "best-00000016.pt", "last.pt")] == [8, 16, 32]
    assert_same_state(load(directory / "best.pt"), load(directory / "best-00000016.pt"))
    assert load(directory / "last.pt")["best"]["kept"] == [[pytest.approx(2.4249, abs=1e-4), 16], [pytest.approx(2.4750, abs=1e-4), 8]]


def test_kill_and_resume_between_improvements_ends_as_the_uninterrupted_run(best_run, tmp_path, monkeypatch):
    """Killed at step 12, after the best at step 8 and the checkpoint at step 10, before the better
    step 16; resumed from step 10 in the same run dir (by train.run in this process: a launch costs
    seconds of start-up): every checkpoint left, best.pt included, and the record of the best are
    bit-identical to the uninterrupted run's."""
    killed = launch([*RANKED_BY["model"], "fault.kill_rank=0", "fault.at_step=12"], tmp_path)
    assert killed.returncode != 0
    run_dir = the_run_dir(tmp_path)
    assert load(run_dir / "checkpoints" / "last.pt")["global_step"] == 10
    monkeypatch.chdir(tmp_path)
    run_in_this_process([*RANKED_BY["model"], f"resume='{run_dir}'"], run_dir)

    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (best_run / "checkpoints").iterdir())
    for name in names:
        resumed, uninterrupted = load(run_dir / "checkpoints" / name), load(best_run / "checkpoints" / name)
        assert_bit_identical(resumed, uninterrupted)
        assert_same_state(resumed["best"], uninterrupted["best"], f"{name}['best']")
    resumed, uninterrupted = results_of(run_dir), results_of(best_run)
    for key in ("best_step", "best_val_loss", "best_val_accuracy", "val_loss", "stopped_early"):
        assert resumed[key] == uninterrupted[key], key


def test_best_of_ema_keeps_the_ema_weights_best_validation(ema_run, best_evaluated):
    """checkpoint.best_of=ema: the EMA weights' val loss ranks (best at step 8, though the raw model's
    best is at step 16). best.pt is step 8's checkpoint, and its mode=eval gives that validation's
    metrics exactly: the EMA weights' (the recorded best) and the raw model's."""
    results = results_of(ema_run)
    ema_losses, losses = dict(scalars(ema_run, "val/ema_loss")), dict(scalars(ema_run, "val/loss"))
    assert results["best_metric"] == "val_ema_loss"
    assert results["best_step"] == min(ema_losses, key=ema_losses.get) == 8
    assert min(losses, key=losses.get) == 16  # ranked by the raw model, step 16 would be the best
    assert [value for _, value in scalars(ema_run, "val/best_ema_loss")] == pytest.approx([ema_losses[8]] * 4, rel=1e-6)

    best = load(ema_run / "checkpoints" / "best.pt")
    assert best["global_step"] == 8 and best["best"]["best"]["step"] == 8
    evaluation = best_evaluated["ema"]
    assert evaluation["step"] == 8
    for key in ("val_ema_loss", "val_ema_accuracy", "val_loss", "val_accuracy"):
        assert evaluation[key] == results[f"best_{key}"], key  # exactly: the same weights, the same exact evaluation


# Each: the run resumed, the overrides that change how it ranks, its record's metric, this run's.
RANKED_OTHERWISE = {
    "another_objective": ("best_run", ["task.objective=val_accuracy", "task.direction=maximize"],
                          "val_loss (minimize)", "val_accuracy (maximize)"),
    "another_direction": ("best_run", ["task.direction=maximize"], "val_loss (minimize)", "val_loss (maximize)"),
    "another_best_of": ("ema_run", ["checkpoint.best_of=model"], "val_ema_loss (minimize)", "val_loss (minimize)"),
}


@pytest.mark.parametrize("fixture, changed, recorded, wanted", RANKED_OTHERWISE.values(), ids=RANKED_OTHERWISE.keys())
def test_a_resume_that_would_rank_otherwise_is_a_one_line_error_before_anything_starts(
        request, tmp_path, monkeypatch, fixture, changed, recorded, wanted):
    """The record (best value, kept files, patience count) was made by one metric in one direction;
    a resume by another would mix them. train.run, in this process: one line naming the keys and the
    two ways on, raised before a process group exists or a file of the run dir changes."""
    run_dir = request.getfixturevalue(fixture)
    args = RANKED_BY["ema" if fixture == "ema_run" else "model"]
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*args, f"resume='{run_dir}'", *changed])  # quoted: a job dir's name has "="
    with pytest.raises(ConfigError) as error:
        train.run(cfg, run_dir, relaunch="")
    line = str(error.value)
    assert "\n" not in line
    assert f"ranked its validations by {recorded}, this run would by {wanted}" in line, line
    assert "task.objective, task.direction and checkpoint.best_of" in line and "model.weights_path=" in line, line
    assert not dist.is_initialized()
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before


@pytest.fixture(scope="module")
def early_run(tmp_path_factory):
    cwd, result = shared_run("best_early_run", checked_launch(EARLY, nproc=2), tmp_path_factory)
    return the_run_dir(cwd), completed_process(result)


STOP_LINE = re.compile(r"\[rank (\d)\]\[train\]\[INFO\] stopped early at epoch (\d+), step (\d+): (.*)")


def test_early_stopping_ends_every_rank_at_the_same_step(early_run):
    """Patience 2: after the best at step 4, two validations without improvement; both ranks stop at
    step 12 (had one gone on, its next collective would fail the job), save, and report it once."""
    run_dir, result = early_run
    results = results_of(run_dir)
    reason = "val_loss did not improve by more than 0 for 2 validations (best 2.3829 at step 4)"
    assert (results["stopped_early"], results["stopped_epoch"], results["stop_reason"]) == (True, 2, reason)
    assert (results["steps"], results["epochs"], results["best_step"]) == (12, 3, 4)
    assert results["replicas_identical"]
    for rank in (0, 1):
        stops = STOP_LINE.findall((run_dir / f"train_rank{rank}.log").read_text())
        assert stops == [(str(rank), "2", "12", reason)], stops
    assert len(STOP_LINE.findall(result.stdout + result.stderr)) == 1  # the console: rank 0's line
    assert load(run_dir / "checkpoints" / "last.pt")["global_step"] == 12  # the stop saved


def resume_in_this_process(run_dir: Path, *overrides: str) -> dict:
    """EARLY's stopped run resumed in one process, by train.run in this one (as in the test above: a
    launch would cost seconds of start-up; resuming a run dir through a launch: tests/test_trainer.py).
    Its results.json."""
    run_in_this_process([*EARLY[1:], f"resume='{run_dir}'", "strategy=single", *overrides], run_dir)
    return results_of(run_dir)


def test_resuming_a_stopped_run_trains_nothing_more_unless_the_patience_grew(early_run, tmp_path, monkeypatch):
    run_dir = shutil.copytree(early_run[0], tmp_path / "copy" / "run")
    monkeypatch.chdir(tmp_path / "copy")
    again = resume_in_this_process(run_dir)
    assert (again["steps"], again["stopped_early"], again["stopped_epoch"]) == (12, True, 2)
    longer = resume_in_this_process(run_dir, "trainer.early_stop_patience=3")
    assert longer["steps"] > 12 and longer["best_step"] == 4  # the record carried over: step 4's best still counts
    # and the count: at 2 already, the next validation without improvement (one epoch: 8 steps in one process) stops it
    assert (longer["steps"], longer["stopped_early"], longer["stopped_epoch"]) == (20, True, 3)


def test_resuming_a_stopped_run_with_more_epochs_goes_on_with_its_record(early_run, tmp_path, monkeypatch):
    """trainer.max_epochs 10 -> 11 at the same patience: the run continues with its best (step 4) and its
    count (2 of 2), so the first validation without improvement, one epoch on, stops it again."""
    run_dir = shutil.copytree(early_run[0], tmp_path / "copy" / "run")
    monkeypatch.chdir(tmp_path / "copy")
    results = resume_in_this_process(run_dir, "trainer.max_epochs=11")
    assert (results["steps"], results["stopped_early"], results["stopped_epoch"], results["best_step"]) == (20, True, 3, 4)
    reason = "val_loss did not improve by more than 0 for 2 validations (best 2.3829 at step 4)"
    assert results["stop_reason"] == reason


def test_a_sweep_ranks_its_jobs_by_their_best_validation(tmp_path):
    """trainer.objective=best: the summary's objective column is best_val_loss, each job's results.json's,
    and the job with the lowest one is marked best. Ranked by the final val loss the other job would win:
    lr 0.2's val losses are 2.388, 2.485; lr 0.5's 2.475, 2.425."""
    result = launch(["-m", *BEST, "trainer.max_epochs=2", "checkpoint.keep_best=1", "trainer.objective=best",
                     "optim.lr=0.5,0.2"], tmp_path)
    check(result)
    (summary,) = tmp_path.rglob("summary.csv")
    with open(summary, newline="") as f:
        rows = list(csv.DictReader(f))
    assert "best_val_loss" in rows[0] and "val_loss" in rows[0]
    for row in rows:
        (job,) = [p for p in summary.parent.iterdir() if p.is_dir() and p.name.startswith(f"{row['job']}_")]
        assert float(row["best_val_loss"]) == results_of(job)["best_val_loss"]
    winner = min(rows, key=lambda row: float(row["best_val_loss"]))
    assert [row["best"] for row in rows] == [str(row is winner) for row in rows]
    assert min(rows, key=lambda row: float(row["val_loss"])) is not winner
