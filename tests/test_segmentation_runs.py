"""task=segmentation end to end, with real processes (python, torchrun, Hydra multirun; CPU, gloo):
small_segnet learns the shapes dataset; SyncBN makes 2 ranks equal one process with their batches;
evaluation is exact at any world size and equals mode=eval of the saved model; a killed rank resumes
bit-identically; a sweep optimises val_miou; DP, accumulation, bf16 and EMA run; MixUp is refused;
TensorBoard gets the image grid. Runs that several tests read are module fixtures."""

import csv
import json
import math

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import check, launch, run_dirs
from test_bad_input import assert_nothing_trained
from test_fault_tolerance import assert_bit_identical, last_checkpoint, torchrun

# 1 thread per process: the suite runs two test processes on two cores, and a second thread per
# process made a training step ~30x slower there (torchrun sets the same for its workers).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

SEG = ["task=segmentation", "data=shapes", "model=small_segnet", "model.width=8", "data.image_size=24",
       "data.num_workers=0"]
# 37 val images: a size that neither 2 nor 3 ranks divide.
VAL = ["data.num_val_samples=37"]
# 2 ranks x batch 8 with SyncBN: 16 steps per epoch, 48 in all, a checkpoint every 5 steps (for the
# kill-and-resume test) and validation after each epoch. Random resize, crop and flip (data.augment)
# draw from the rank's global RNG, which a checkpoint restores.
LEARN = ["strategy=ddp", "syncbn=true", *SEG, *VAL, "data.num_samples=256", "data.batch_size=8", "optim=adam",
         "optim.lr=0.003", "trainer.max_epochs=3", "trainer.log_every_n_steps=4", "checkpoint.every_n_steps=5"]
STEPS = 48
GRID = (4 * (24 + 2) + 2, 3 * (24 + 2) + 2)  # make_grid of 4 rows x (input, target, prediction), 2 px apart


def results_in(cwd) -> dict:
    (run_dir,) = run_dirs(cwd)
    return json.loads((run_dir / "results.json").read_text())


def eval_results_in(cwd) -> dict:
    (eval_json,) = (cwd / "outputs").rglob("eval.json")
    return json.loads(eval_json.read_text())


def metrics_of(results: dict) -> dict:
    return {key: value for key, value in results.items() if key.startswith("val_") and "ema" not in key}


def assert_same_metrics(actual: dict, expected: dict, where: str) -> None:
    """Counts exactly: pixel accuracy, every IoU and mIoU come from integer confusion counts. The loss
    is a float64 sum of float32 logits' cross-entropies, over other batch groupings."""
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        if key == "val_loss":
            assert actual[key] == pytest.approx(value, rel=1e-6), where
        else:
            assert actual[key] == value or (math.isnan(actual[key]) and math.isnan(value)), (where, key, actual[key], value)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """LEARN on 2 ranks: (run dir, results)."""
    cwd = tmp_path_factory.mktemp("seg_learn")
    check(launch(LEARN, cwd, nproc=2, timeout=300))
    (run_dir,) = run_dirs(cwd)
    return run_dir, results_in(cwd)


def test_small_segnet_learns_shapes_to_miou_above_half(learned):
    _, results = learned
    assert results["steps"] == STEPS and results["world_size"] == 2
    assert results["val_miou"] > 0.5, results
    assert results["val_samples"] == 37
    names = ("background", "rectangle", "disc", "triangle")
    assert {key for key in results if key.startswith("val_iou/")} == {f"val_iou/{name}" for name in names}
    assert results["val_miou"] == pytest.approx(sum(results[f"val_iou/{name}"] for name in names) / 4)
    assert 0 < results["val_pixel_accuracy"] <= 1 and results["replicas_identical"] is True


def test_tensorboard_gets_the_metrics_and_an_image_grid_at_each_validation(learned):
    run_dir, results = learned
    (events_file,) = run_dir.glob("events.out.tfevents*")
    accumulator = EventAccumulator(str(events_file), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    images = accumulator.Images("val/images")
    assert [image.step for image in images] == [16, 32, 48]
    assert {(image.height, image.width) for image in images} == {GRID}
    assert len({image.encoded_image_string for image in images}) == 3  # the predictions change as it learns
    assert accumulator.Scalars("val/miou")[-1].value == pytest.approx(results["val_miou"])
    assert accumulator.Scalars("val/iou/disc")[-1].value == pytest.approx(results["val_iou/disc"])
    # the task's objective ranks the validations for best.pt: val_miou, higher is better
    mious = {scalar.step: scalar.value for scalar in accumulator.Scalars("val/miou")}
    best_step = max(mious, key=mious.get)
    assert results["best_step"] == best_step and results["best_val_miou"] == pytest.approx(mious[best_step])
    assert [scalar.value for scalar in accumulator.Scalars("val/best_miou")] == pytest.approx(
        [max(list(mious.values())[:n]) for n in range(1, len(mious) + 1)])


# --- evaluation: exact at any world size, and the saved model's -------------------------------------

@pytest.fixture(scope="module")
def evaluated(learned, tmp_path_factory):
    """mode=eval of the learned run's checkpoint in one process and on 3 ranks: {world size: eval.json}."""
    run_dir, _ = learned
    evaluations = {}
    for nproc in (None, 3):
        cwd = tmp_path_factory.mktemp(f"seg_eval_{nproc or 1}")
        args = [*SEG, *VAL, "mode=eval", f"resume={run_dir}", "strategy=ddp" if nproc else "strategy=single"]
        check(launch(args, cwd, nproc=nproc, env=ONE_THREAD, timeout=240))
        evaluations[nproc or 1] = eval_results_in(cwd)
    return evaluations


def test_val_metrics_are_exact_at_world_sizes_1_2_3_and_equal_mode_eval_of_the_checkpoint(learned, evaluated):
    """The 2-rank run's own val metrics (37 images: 19 + 18) equal mode=eval of its last.pt in one process
    and on 3 ranks (13 + 12 + 12): every image counted once, the confusion matrices summed by one all_reduce."""
    _, results = learned
    one_process, three_ranks = evaluated[1], evaluated[3]
    assert (one_process["world_size"], three_ranks["world_size"]) == (1, 3)
    assert one_process["step"] == three_ranks["step"] == STEPS
    assert one_process["val_samples"] == three_ranks["val_samples"] == results["val_samples"] == 37
    assert_same_metrics(metrics_of(one_process), metrics_of(results), "mode=eval, 1 process vs the 2-rank run")
    assert_same_metrics(metrics_of(three_ranks), metrics_of(one_process), "mode=eval, 3 ranks vs 1 process")


# --- resume ---------------------------------------------------------------------------------------

def test_killed_rank_resumes_bit_identical(learned, tmp_path):
    """Rank 1 killed at step 7, torchrun restarts both from the step-5 checkpoint: the run ends exactly
    where the uninterrupted one did (weights, optimizer, position, every rank's RNG states)."""
    run_dir, _ = learned
    result = torchrun([*LEARN, "fault.kill_rank=1", "fault.at_step=7"], tmp_path, max_restarts=1, timeout=300)
    check(result)
    (resumed_dir,) = run_dirs(tmp_path)
    assert "killing this rank at step 7" in (resumed_dir / "train_rank1.log").read_text()
    assert_bit_identical(last_checkpoint(resumed_dir), last_checkpoint(run_dir))
    assert metrics_of(results_in(tmp_path)) == metrics_of(learned[1])


# --- SyncBN ---------------------------------------------------------------------------------------

# Without augmentation every pixel counts, so each rank's mean loss has the same weight; SGD, as the
# classification invariance test. 64 images: 16 steps of a global batch of 4.
INVARIANCE = [*SEG, *VAL, "data.num_samples=64", "data.augment=false", "trainer.max_epochs=1",
              "checkpoint.every_n_steps=0"]


def test_syncbn_two_ranks_of_batch_2_equal_one_process_of_batch_4(tmp_path):
    """With syncbn=true BatchNorm normalises over both ranks' images, so 2 ranks x batch 2 train the
    model that 1 process x batch 4 does, within float noise (the tolerance of the classification
    test: torch.testing.assert_close's float32 defaults). The val metrics agree too."""
    ddp_cwd, single_cwd = tmp_path / "ddp", tmp_path / "single"
    ddp_cwd.mkdir(), single_cwd.mkdir()
    check(launch(["strategy=ddp", "syncbn=true", *INVARIANCE, "data.batch_size=2"], ddp_cwd, nproc=2))
    check(launch(["strategy=single", *INVARIANCE, "data.batch_size=4"], single_cwd, env=ONE_THREAD))
    ddp, single = (last_checkpoint(run_dirs(cwd)[0])["model"] for cwd in (ddp_cwd, single_cwd))
    assert ddp.keys() == single.keys() and any(key.endswith("running_var") for key in ddp)
    assert ddp["backbone.0.1.num_batches_tracked"].item() == 16  # SyncBN steps, once per global batch
    worst = max((ddp[key].double() - single[key].double()).abs().max().item() for key in ddp)
    for key in ddp:
        torch.testing.assert_close(ddp[key], single[key], msg=lambda m, key=key: f"{key}: {m} (max difference {worst:g})")
    ddp_results, single_results = results_in(ddp_cwd), results_in(single_cwd)
    assert ddp_results["steps"] == single_results["steps"] == 16
    assert ddp_results["val_miou"] == pytest.approx(single_results["val_miou"], abs=1e-3)


# --- the rest of the trainer with segmentation ---------------------------------------------------

@pytest.fixture(scope="module")
def dp_sweep(tmp_path_factory):
    """A 2-trial Optuna search whose jobs run DataParallel, accumulation (2 micro-batches per update),
    bf16 and EMA at once, in one process: (sweep dir, each job's results)."""
    cwd = tmp_path_factory.mktemp("seg_dp_sweep")
    args = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=dp", *SEG, "data.num_samples=48",
            "data.num_val_samples=8", "trainer.max_epochs=1", "trainer.accumulate_grad_batches=2", "precision=bf16",
            "ema.decay=0.9"]
    check(launch(args, cwd, env=ONE_THREAD, timeout=300))
    (sweep_dir,) = (cwd / "outputs" / "multirun").iterdir()
    return sweep_dir, [json.loads(path.read_text()) for path in sorted(sweep_dir.glob("*/results.json"))]


def test_dataparallel_accumulation_bf16_and_ema_train_segmentation(dp_sweep):
    _, jobs = dp_sweep
    assert len(jobs) == 2
    for results in jobs:
        assert (results["strategy"], results["precision"], results["accumulate_grad_batches"]) == ("dp", "bf16", 2)
        assert results["global_batch_size"] == 2 * results["batch_size"]
        assert results["steps"] == math.ceil(math.ceil(48 / results["batch_size"]) / 2)
        for key in ("val_miou", "val_pixel_accuracy", "val_loss", "val_ema_miou", "val_ema_loss"):
            assert math.isfinite(results[key]), key
        assert results["val_samples"] == 8


def test_a_two_job_optuna_sweep_maximises_val_miou(dp_sweep):
    """main returns val_miou (the task's objective), which Optuna maximises (the task's direction)."""
    sweep_dir, jobs = dp_sweep
    optuna_results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna_results["best_value"] == pytest.approx(max(results["val_miou"] for results in jobs), rel=1e-12)
    with open(sweep_dir / "summary.csv", newline="") as summary:
        rows = list(csv.DictReader(summary))  # the sweep's summary ranks the jobs by val_miou too
    assert [row["status"] for row in rows] == ["ok", "ok"]
    (best,) = [row for row in rows if row["best"] == "True"]
    assert float(best["val_miou"]) == pytest.approx(optuna_results["best_value"], rel=1e-12)


def test_mixup_with_segmentation_is_a_one_line_error(tmp_path):
    """(Label smoothing and CutMix are refused the same way: tests/test_segmentation.py.)"""
    result = launch([*SEG, "data.mixup_alpha=0.2"], tmp_path, env=ONE_THREAD, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: data.mixup_alpha=0.2: task=segmentation trains on hard per-pixel labels; set data.mixup_alpha=0"]
    assert_nothing_trained(tmp_path, result)
