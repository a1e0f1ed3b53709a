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
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import check, launch, run_dirs
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


def the_run_dir(cwd: Path) -> Path:
    (run_dir,) = run_dirs(cwd)
    return run_dir


def results_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@pytest.fixture(scope="module")
def best_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("best")
    check(launch(BEST, cwd))
    return the_run_dir(cwd)


def test_best_pt_holds_the_best_validation_and_evaluates_to_it_exactly(best_run, tmp_path):
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
    result = launch(["mode=eval", f"resume={best_run / 'checkpoints' / 'best.pt'}", *BEST[1:6]], tmp_path)
    check(result)
    (evaluation,) = [json.loads(path.read_text()) for path in tmp_path.rglob("eval.json")]
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


def test_kill_and_resume_between_improvements_ends_as_the_uninterrupted_run(best_run, tmp_path):
    """Killed at step 12, after the best at step 8 and the checkpoint at step 10, before the better
    step 16; resumed from step 10 in the same run dir: every checkpoint left, best.pt included, and
    the record of the best are bit-identical to the uninterrupted run's."""
    killed = launch([*BEST, "fault.kill_rank=0", "fault.at_step=12"], tmp_path)
    assert killed.returncode != 0
    run_dir = the_run_dir(tmp_path)
    assert load(run_dir / "checkpoints" / "last.pt")["global_step"] == 10
    check(launch([*BEST, f"resume={run_dir}"], tmp_path))

    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (best_run / "checkpoints").iterdir())
    for name in names:
        resumed, uninterrupted = load(run_dir / "checkpoints" / name), load(best_run / "checkpoints" / name)
        assert_bit_identical(resumed, uninterrupted)
        assert_same_state(resumed["best"], uninterrupted["best"], f"{name}['best']")
    resumed, uninterrupted = results_of(run_dir), results_of(best_run)
    for key in ("best_step", "best_val_loss", "best_val_accuracy", "val_loss", "stopped_early"):
        assert resumed[key] == uninterrupted[key], key


@pytest.fixture(scope="module")
def early_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("early")
    result = launch(EARLY, cwd, nproc=2)
    check(result)
    return the_run_dir(cwd), result


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


def test_resuming_a_stopped_run_trains_nothing_more_unless_the_patience_grew(early_run, tmp_path):
    run_dir = shutil.copytree(early_run[0], tmp_path / "copy" / "run")
    check(launch([*EARLY[1:], f"resume={run_dir}", "strategy=single"], tmp_path / "copy"))
    again = results_of(run_dir)
    assert (again["steps"], again["stopped_early"], again["stopped_epoch"]) == (12, True, 2)
    check(launch([*EARLY[1:], f"resume={run_dir}", "strategy=single", "trainer.early_stop_patience=3"], tmp_path / "copy"))
    longer = results_of(run_dir)
    assert longer["steps"] > 12 and longer["best_step"] == 4  # the record carried over: step 4's best still counts


def test_a_sweep_ranks_its_jobs_by_their_best_validation(tmp_path):
    """trainer.objective=best: the summary's objective column is best_val_loss, each job's results.json's,
    and the job with the lowest one is marked best."""
    result = launch(["-m", *BEST, "trainer.max_epochs=2", "checkpoint.keep_best=1", "trainer.objective=best",
                     "optim.lr=0.5,0.05"], tmp_path)
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
