"""task=segmentation end to end, with real processes (python, torchrun, Hydra multirun; CPU, gloo):
small_segnet learns the shapes dataset; SyncBN makes 2 ranks equal one process with their batches;
evaluation is exact at any world size and equals mode=eval of the saved model; a resume from a
mid-run checkpoint ends bit-identically (the kill itself: tests/test_fault_tolerance.py); a sweep
optimises val_miou; DP, accumulation, bf16 and EMA run; TensorBoard gets the image grid. Runs that
several tests read are fixtures shared by the test processes (conftest.shared_run).
MixUp's refusal is one of tests/test_bad_input.py's config errors (in process, as the others of the
task's refusals are in tests/test_segmentation.py)."""

import csv
import json
import math

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from conftest import REPO, check, launch, run_dirs, shared_run
from data.segmentation_transforms import IGNORE_INDEX
from data.voc import build_voc
from test_fault_tolerance import assert_bit_identical, last_checkpoint, torchrun
from test_segmentation import _write_voc

# 1 thread per process: the suite runs several test processes on two cores, and a second thread per
# process made a training step ~30x slower there (torchrun sets the same for its workers).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

SEG = ["task=segmentation", "data=shapes", "model=small_segnet", "model.width=8", "data.image_size=24",
       "data.num_workers=0"]
# 37 val images: a size that neither 2 nor 3 ranks divide.
VAL = ["data.num_val_samples=37"]
# 2 ranks x batch 8 with SyncBN: 16 steps per epoch, 48 in all, a checkpoint every 5 steps and at each
# epoch's end, all 12 kept (the resume test starts from step 5), and validation after each epoch.
# Random resize, crop and flip (data.augment) draw from the rank's global RNG, which a checkpoint restores.
LEARN = ["strategy=ddp", "syncbn=true", *SEG, *VAL, "data.num_samples=256", "data.batch_size=8", "optim=adam",
         "optim.lr=0.003", "trainer.max_epochs=3", "trainer.log_every_n_steps=4", "checkpoint.every_n_steps=5",
         "checkpoint.keep_last=12"]
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


def run_learn(cwd) -> dict:
    # torchrun's default, a store shared with the workers: the ranks agree on the run dir through it
    # (the suite's other launches disable it, as restarts on gloo need)
    check(launch(LEARN, cwd, nproc=2, timeout=300, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}))
    return {}


@pytest.fixture
def learned(tmp_path_factory):
    """LEARN on 2 ranks: (run dir, results)."""
    cwd, _ = shared_run("seg_learn", run_learn, tmp_path_factory)
    (run_dir,) = run_dirs(cwd)
    return run_dir, results_in(cwd)


def test_ranks_agree_on_the_run_dir_with_torchruns_shared_store(learned):
    """One run dir for both ranks, each with its own log, through torchrun's shared store."""
    run_dir, _ = learned
    assert run_dirs(run_dir.parents[1]) == [run_dir]
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]


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

@pytest.fixture
def evaluated(learned, tmp_path_factory):
    """mode=eval of the learned run's checkpoint in one process and on 3 ranks: {world size: eval.json}.
    One process is train.run in this process (a launch would cost seconds of start-up); 3 ranks are
    torchrun's."""
    run_dir, _ = learned

    def evaluate_in(cwd) -> dict:
        args = [*SEG, *VAL, "mode=eval", f"resume={run_dir}"]
        (cwd / "1").mkdir()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*args, "strategy=single"])
        train.run(cfg, cwd / "1", relaunch="")
        (cwd / "3").mkdir()
        check(launch([*args, "strategy=ddp"], cwd / "3", nproc=3, env=ONE_THREAD, timeout=240))
        return {"1": json.loads((cwd / "1" / "eval.json").read_text()), "3": eval_results_in(cwd / "3")}

    _, evaluations = shared_run("seg_eval", evaluate_in, tmp_path_factory)
    return {int(world_size): results for world_size, results in evaluations.items()}  # JSON keys are strings


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

def test_a_resume_from_the_step_5_checkpoint_ends_bit_identical(learned, tmp_path):
    """A fresh torchrun launch resumed from the learned run's step-5 checkpoint (mid-epoch 1, with
    SyncBN buffers and the augmentation's RNG) ends exactly where the uninterrupted run did (weights,
    optimizer, position, every rank's RNG states) and validates the same, across two epoch boundaries.
    That a killed rank is restarted from its run's last checkpoint is tests/test_fault_tolerance.py's
    test_killed_rank_is_restarted_and_ends_bit_identical; this test is about what a resume restores."""
    run_dir, results = learned
    step_5 = run_dir / "checkpoints" / "step-00000005.pt"
    result = torchrun([*LEARN, f"resume={step_5}"], tmp_path, timeout=300)
    check(result)
    assert f"resumed from {step_5} at epoch 0, batch 5, step 5" in result.stdout  # not a fresh run
    (resumed_dir,) = run_dirs(tmp_path)
    assert_bit_identical(last_checkpoint(resumed_dir), last_checkpoint(run_dir))
    assert metrics_of(results_in(tmp_path)) == metrics_of(results)


# --- SyncBN ---------------------------------------------------------------------------------------

# Without augmentation every pixel counts, so each rank's mean loss has the same weight (a crop padded
# with ignored pixels would weigh a rank's pixels more than one process does; the draws themselves are
# per sample, the same at any world size); SGD, as the classification invariance test. 64 images: 16
# steps of a global batch of 4.
INVARIANCE = [*SEG, *VAL, "data.num_samples=64", "data.augment=false", "trainer.max_epochs=1",
              "checkpoint.every_n_steps=0"]


def test_syncbn_two_ranks_of_batch_2_equal_one_process_of_batch_4(tmp_path):
    """With syncbn=true BatchNorm normalises over both ranks' images, so 2 ranks x batch 2 train the
    model that 1 process x batch 4 does, within float noise (the tolerance of the classification
    test: torch.testing.assert_close's float32 defaults). The val metrics agree too."""
    ddp_cwd, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_cwd.mkdir(), single_dir.mkdir()
    check(launch(["strategy=ddp", "syncbn=true", *INVARIANCE, "data.batch_size=2"], ddp_cwd, nproc=2))
    # one process: train.run in this one (one thread, as the ranks; a launch would cost seconds of start-up)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=single", *INVARIANCE, "data.batch_size=4"])
    train.run(cfg, single_dir, relaunch="")
    ddp, single = last_checkpoint(run_dirs(ddp_cwd)[0])["model"], last_checkpoint(single_dir)["model"]
    assert ddp.keys() == single.keys() and any(key.endswith("running_var") for key in ddp)
    assert ddp["backbone.0.1.num_batches_tracked"].item() == 16  # SyncBN steps, once per global batch
    worst = max((ddp[key].double() - single[key].double()).abs().max().item() for key in ddp)
    for key in ddp:
        torch.testing.assert_close(ddp[key], single[key], msg=lambda m, key=key: f"{key}: {m} (max difference {worst:g})")
    ddp_results, single_results = results_in(ddp_cwd), json.loads((single_dir / "results.json").read_text())
    assert ddp_results["steps"] == single_results["steps"] == 16
    assert ddp_results["val_miou"] == pytest.approx(single_results["val_miou"], abs=1e-3)


def test_an_all_ignore_mask_at_batch_1_counts_for_nothing_under_ddp(tmp_path):
    """A VOC training mask that is all 255 (ignore), at batch 1 on 2 ranks: one rank's batch has no
    counted pixel while the other's has. Its loss is 0, not NaN, so the run is no "training diverged"
    (the guard checks every step here); its backward still runs, so DDP's reducer stays in step, and the
    weights stay finite and equal on both ranks."""
    root = tmp_path / "voc"
    _write_voc(root, {"blank": (16, 16), "a": (16, 16), "b": (16, 16)}, {"train": ["blank", "a"], "val": ["a", "b"]})
    path = root / "SegmentationClass" / "blank.png"
    palette = Image.open(path).getpalette()
    blank = Image.fromarray(np.full((16, 16), IGNORE_INDEX, dtype=np.uint8), mode="P")
    blank.putpalette(palette)
    blank.save(path)
    assert (build_voc(str(root), num_classes=4).train[0][1] == IGNORE_INDEX).all()
    cwd = tmp_path / "run"
    cwd.mkdir()
    check(launch(["strategy=ddp", "task=segmentation", "data=voc", f"data.root={root}", "data.num_classes=4",
                  "data.base_size=16", "data.crop_size=16", "data.num_workers=0", "data.batch_size=1",
                  "model=small_segnet", "model.width=4", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"],
                 cwd, nproc=2, env=ONE_THREAD))
    results = results_in(cwd)
    assert results["steps"] == 2 and results["replicas_identical"] is True
    assert math.isfinite(results["train_loss"]) and math.isfinite(results["val_loss"])
    weights = last_checkpoint(run_dirs(cwd)[0])["model"]
    assert all(torch.isfinite(value).all() for value in weights.values() if value.is_floating_point())


# --- the rest of the trainer with segmentation ---------------------------------------------------

def run_dp_sweep(cwd) -> dict:
    args = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=dp", *SEG, "data.num_samples=48",
            "data.num_val_samples=8", "trainer.max_epochs=1", "trainer.accumulate_grad_batches=2", "precision=bf16",
            "ema.decay=0.9"]
    check(launch(args, cwd, env=ONE_THREAD, timeout=300))
    return {}


@pytest.fixture
def dp_sweep(tmp_path_factory):
    """A 2-trial Optuna search whose jobs run DataParallel, accumulation (2 micro-batches per update),
    bf16 and EMA at once, in one process: (sweep dir, each job's results)."""
    cwd, _ = shared_run("seg_dp_sweep", run_dp_sweep, tmp_path_factory)
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
