"""task=detection end to end, with real processes (torchrun, CPU, gloo): small_fcos learns the generated
shapes on 2 ranks with SyncBN, aspect-ratio grouping and loader workers; a rank killed mid-epoch is
restarted and the run ends bit-identical; the COCO metrics (pycocotools) of the 2-rank run equal
mode=eval of its checkpoint in one process and on 3 ranks, with ==; a lost prediction is an error;
2 ranks x B train what 1 x 2B does, for FCOS and for Faster R-CNN with its per-image samplers.
The data's own properties: tests/test_detection_data.py; the grouping's: tests/test_aspect_ratio_groups.py;
the refusals: tests/test_bad_input.py."""

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from conftest import REPO, check, launch, last_checkpoint, run_dirs, shared_run
from data.detection_shapes import build_detection_shapes
from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_val_loader
from ddp.training.evaluation import IncompleteEvaluation, evaluate
from models.detection import build_detection_model
from tasks.detection import COCO_STATS, DetectionTask
from test_fault_tolerance import RESTARTABLE, assert_bit_identical, rank_log, torchrun

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
DET = ["task=detection", "model=detection", "model.name=small_fcos", "data=detection_shapes"]
# 37 val images: a size that neither 2 nor 3 ranks divide.
VAL = ["data.num_val_samples=37"]
# 2 ranks x batch 4 with SyncBN, 128 images in groups of aspect ratio, 2 loader workers a rank: 16 steps
# an epoch, 64 in all; a checkpoint every 5 steps, validation after each epoch.
LEARN = ["strategy=ddp", "syncbn=true", *DET, *VAL, "data.num_samples=128", "data.batch_size=4", "data.num_workers=2",
         "data.aspect_ratio_groups=3", "optim.lr=0.02", "trainer.max_epochs=4", "trainer.log_every_n_steps=4",
         "checkpoint.every_n_steps=5"]
STEPS = 64


def results_in(cwd) -> dict:
    (run_dir,) = run_dirs(cwd)
    return json.loads((run_dir / "results.json").read_text())


def metrics_of(results: dict) -> dict:
    """The val metrics, NaN (a statistic with nothing to rank) as a string, so that == compares them."""
    return {key: "nan" if isinstance(value, float) and math.isnan(value) else value
            for key, value in results.items() if key.startswith("val_")}


def run_learn(cwd) -> dict:
    check(launch(LEARN, cwd, nproc=2, timeout=300))
    return {}


@pytest.fixture
def learned(tmp_path_factory):
    """LEARN on 2 ranks: (run dir, results)."""
    cwd, _ = shared_run("det_learn", run_learn, tmp_path_factory)
    (run_dir,) = run_dirs(cwd)
    return run_dir, results_in(cwd)


def test_small_fcos_learns_the_shapes(learned):
    """val_map climbs well above its first validation's, and the results carry every COCO statistic."""
    run_dir, results = learned
    assert results["steps"] == STEPS and results["world_size"] == 2 and results["replicas_identical"] is True
    assert results["val_samples"] == 37
    assert {f"val_{name}" for name in COCO_STATS} <= results.keys()
    accumulator = EventAccumulator(str(next(run_dir.glob("events.out.tfevents*"))), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    maps = [scalar.value for scalar in accumulator.Scalars("val/map")]
    assert len(maps) == 4 and maps[-1] == pytest.approx(results["val_map"])
    assert results["val_map"] > max(0.1, 2 * maps[0]), maps


def test_tensorboard_gets_each_loss_term_and_an_image_grid_at_each_validation(learned):
    run_dir, _ = learned
    accumulator = EventAccumulator(str(next(run_dir.glob("events.out.tfevents*"))), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    for term in ("classification", "bbox_regression", "bbox_ctrness"):  # FCOS's named losses
        assert [scalar.step for scalar in accumulator.Scalars(f"train/{term}")] == list(range(4, STEPS + 1, 4)), term
    images = accumulator.Images("val/images")
    assert [image.step for image in images] == [16, 32, 48, 64]
    assert len({image.encoded_image_string for image in images}) == 4  # the detections change as it learns


def test_a_rank_killed_mid_epoch_is_restarted_and_the_run_ends_bit_identical(learned, tmp_path):
    """SIGKILL of rank 1 at step 7, one restart: both ranks resume from the step-5 checkpoint, 5 of the
    first epoch's 16 batches in, with aspect-ratio grouping and 2 loader workers a rank, and the run ends
    exactly where the uninterrupted one did (weights, optimizer, position, every rank's RNG states)."""
    run_dir, results = learned
    check(torchrun([*LEARN, "fault.kill_rank=1", "fault.at_step=7"], tmp_path, max_restarts=1, timeout=400))
    (killed_dir,) = run_dirs(tmp_path)
    assert "fault.kill_rank=1: killing this rank at step 7" in rank_log(killed_dir, 1)
    assert "at epoch 0, batch 5, step 5" in rank_log(killed_dir, 0)
    assert_bit_identical(last_checkpoint(killed_dir), last_checkpoint(run_dir))
    assert metrics_of(results_in(tmp_path)) == metrics_of(results)


@pytest.fixture
def evaluated(learned, tmp_path_factory):
    """mode=eval of the learned run's checkpoint in this process, on 3 DDP ranks and on 2 FSDP ranks (each of whose
    forwards is a collective, over shards of 19 and 18 images): {"1", "3", "fsdp": eval.json}."""
    run_dir, _ = learned

    def evaluate_in(cwd) -> dict:
        args = [*DET, *VAL, "mode=eval", f"resume={run_dir}"]
        (cwd / "1").mkdir()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*args, "strategy=single"])
        train.run(cfg, cwd / "1", relaunch="")
        (cwd / "3").mkdir()
        check(launch([*args, "strategy=ddp"], cwd / "3", nproc=3, env=ONE_THREAD, timeout=240))
        (cwd / "fsdp").mkdir()
        check(launch([*args, "strategy=fsdp", "strategy.block_types=[Sequential]"], cwd / "fsdp", nproc=2, env=ONE_THREAD, timeout=240))
        (three,), (sharded,) = (cwd / "3" / "outputs").rglob("eval.json"), (cwd / "fsdp" / "outputs").rglob("eval.json")
        return {"1": json.loads((cwd / "1" / "eval.json").read_text()), "3": json.loads(three.read_text()),
                "fsdp": json.loads(sharded.read_text())}

    _, evaluations = shared_run("det_eval", evaluate_in, tmp_path_factory)
    return evaluations


def test_coco_metrics_are_equal_at_world_sizes_1_2_3_under_ddp_and_fsdp_and_mode_eval(learned, evaluated):
    """The 2-rank run's final validation (37 images: 19 + 18), mode=eval of its last.pt in one process, on 3
    DDP ranks (13 + 12 + 12) and on 2 FSDP ranks: pycocotools on the same gathered detections, so the same
    numbers, with ==."""
    _, results = learned
    assert [evaluated[run]["world_size"] for run in ("1", "3", "fsdp")] == [1, 3, 2]
    assert evaluated["1"]["val_samples"] == evaluated["3"]["val_samples"] == evaluated["fsdp"]["val_samples"] == 37
    assert metrics_of(evaluated["1"]) == metrics_of(results)
    assert metrics_of(evaluated["3"]) == metrics_of(evaluated["1"])
    assert metrics_of(evaluated["fsdp"]) == metrics_of(evaluated["1"])


class LosesOnePrediction(DetectionTask):
    """The detections of the first image of an evaluation, dropped (or given twice): as a bug in a gather would."""

    changed, twice = False, False

    def eval_step(self, model, batch):
        sums, records = super().eval_step(model, batch)
        if not self.changed:
            self.changed, records = True, records + records[:1] if self.twice else records[1:]
        return sums, records


def test_an_image_without_its_predictions_or_with_them_twice_is_an_error_not_another_score():
    splits = build_detection_shapes(num_samples=8, num_val_samples=5, image_size=32)
    loader = build_val_loader(splits.val, compose_data(), DistEnv(), pin_memory=False)
    model = build_detection_model(splits.num_classes, 3, "small_fcos")
    complete = evaluate(model, loader, torch.device("cpu"), -1, DetectionTask(splits.num_classes))
    assert complete["val_samples"] == 5
    with pytest.raises(IncompleteEvaluation, match="4 distinct samples have predictions, of the 5 evaluated"):
        evaluate(model, loader, torch.device("cpu"), -1, LosesOnePrediction(splits.num_classes))
    repeats = LosesOnePrediction(splits.num_classes)
    repeats.twice = True
    with pytest.raises(IncompleteEvaluation, match=r"5 distinct samples .* of the 5 evaluated; counted more than once: \[1\]"):
        evaluate(model, loader, torch.device("cpu"), -1, repeats)


def compose_data():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["data=detection_shapes"]).data


# --- world-size invariance ---------------------------------------------------------------------

# Every image the same size (lsj: a 48 px square crop of a rescaled image), so no image is padded by its
# batch-mates; SyncBN; augmentation on (its draws are per sample); SGD at a learning rate where training is
# stable (at 0.01, 8 steps agree to 1e-6 and then the float noise grows 60-fold in 4 steps). 64 images: 16 steps of 4.
INVARIANCE = [*DET, "data.num_samples=64", "data.num_val_samples=8", "data.augment=lsj", "data.lsj_size=48",
              "data.aspect_ratio_groups=2", "trainer.max_epochs=1", "checkpoint.every_n_steps=0", "optim.lr=0.001"]


@pytest.mark.parametrize("name", ["small_fcos", "small_fasterrcnn"])
def test_two_ranks_of_batch_2_train_what_one_process_of_batch_4_does(name, tmp_path):
    """FCOS divides its losses by the global batch's foreground count, and Faster R-CNN's RPN and ROI
    heads sample each image's boxes from that image's own seed: so with SyncBN, 2 ranks x 2 images train
    the model of 1 process x 4, within float noise (torch.testing.assert_close's float32 tolerance)."""
    ddp_cwd, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_cwd.mkdir(), single_dir.mkdir()
    args = [*INVARIANCE, f"model.name={name}"]
    check(launch(["strategy=ddp", "syncbn=true", *args, "data.batch_size=2"], ddp_cwd, nproc=2, env=ONE_THREAD))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=single", *args, "data.batch_size=4"])
    train.run(cfg, single_dir, relaunch="")
    ddp, single = last_checkpoint(run_dirs(ddp_cwd)[0])["model"], last_checkpoint(single_dir)["model"]
    assert ddp.keys() == single.keys() and any(key.endswith("running_var") for key in ddp)
    worst = max((ddp[key].double() - single[key].double()).abs().max().item() for key in ddp)
    for key in ddp:
        torch.testing.assert_close(ddp[key], single[key], msg=lambda m, key=key: f"{key}: {m} (max difference {worst:g})")


def test_syncbn_converts_a_detectors_batchnorm_and_leaves_frozen_batchnorm_frozen():
    """model.frozen_batchnorm=true gives the backbone FrozenBatchNorm2d (a pretrained backbone's), which
    syncbn=true's conversion leaves as it is; the BatchNorm of a detector built without it is converted."""
    from torchvision.ops import FrozenBatchNorm2d

    from ddp.distributed.syncbn import CPUSyncBatchNorm, convert_syncbn

    frozen = convert_syncbn(build_detection_model(4, 3, "small_fasterrcnn", frozen_batchnorm=True), torch.device("cpu"))
    kinds = [type(module) for module in frozen.backbone.modules() if "BatchNorm" in type(module).__name__]
    assert kinds and set(kinds) == {FrozenBatchNorm2d}
    assert all(not parameter.requires_grad for module in frozen.modules() if isinstance(module, FrozenBatchNorm2d)
               for parameter in module.parameters())
    trained = convert_syncbn(build_detection_model(4, 3, "small_fasterrcnn"), torch.device("cpu"))
    assert {type(module) for module in trained.modules() if "BatchNorm" in type(module).__name__} == {CPUSyncBatchNorm}
