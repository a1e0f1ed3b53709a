"""task=simclr (tasks/simclr.py) end to end, with real processes (torchrun, gloo, a Hydra multirun):
NT-Xent equals the paper's formula; 2 ranks x 8 with SyncBN, under DDP and FSDP, train what 1 process
x 16 does, and only with the negatives gathered from every rank; the online probe learns; mode=eval is
exact at 1 and 3 ranks, takes the checkpoint's task without task= (or data.views), and names task when
another task's heads don't fit; a resume from a mid-epoch checkpoint, with the views' augmentation on, ends
bit-identical; the backbone (also exported from FSDP's sharded checkpoint) loads through
model.weights_path, its features are learned and it fine-tunes; the heads load with task=simclr; bad
settings are one line each. Runs that several tests read are fixtures shared by the test processes
(conftest.shared_run)."""

import json
import logging
import math
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from sklearn.linear_model import LogisticRegression
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn import functional as F

from conftest import (REPO, check, config_error_in_this_process, last_checkpoint, launch, results_of, run_dirs,
                      run_in_this_process, shared_run)
from data.digits import build_digits
from ddp.checkpoints.export import export_model
from ddp.checkpoints.sharded_checkpoint import full_model_state
from ddp.config.schema import ConfigError, register_configs
from ddp.distributed.fsdp import find_blocks
from models import build_model
from models.weights import find_classifier
from models.small_cnn import SmallCNN
from tasks.simclr import SimCLRTask, nt_xent
from test_fault_tolerance import assert_bit_identical

# Digits, two views of each image: small_cnn [32, 64], SGD at lr 0.02 (0.05 made the online probe's
# accuracy swing between validations).
DIGITS = ["task=simclr", "data=digits", "data.views=2", "data.num_workers=0", "model.channels=[32,64]"]
# 2 ranks x 16 with SyncBN and the views' random crops, drawn in the main process from
# each rank's global RNG (which checkpoints hold): 1438 images, 45 steps an epoch (each rank's last
# batch 15), 135 in all; checkpoints at step 100 (epoch 2, batch 10) and at the end.
PRETRAIN = ["strategy=ddp", "syncbn=true", *DIGITS, "data.augment=true", "data.batch_size=16", "optim.lr=0.02",
            "trainer.max_epochs=3", "trainer.log_every_n_steps=5", "checkpoint.every_n_steps=100", "checkpoint.keep_last=5",
            "checkpoint.keep_best=0"]
STEPS = 135
VAL_SAMPLES = 359
# Invariance: each view's random crop, flip and blur, drawn per sample (so the same for 2 ranks as for one
# process), 4 updates of a global batch of 16 (64 samples, one epoch). The ranks load in 2 workers each,
# the one process in itself.
INVARIANCE = ["task=simclr", "data=synthetic", "data.views=2", "data.augment=true", "data.num_samples=64",
              "data.num_val_samples=37", "data.image_size=8", "model.channels=[8,16]", "trainer.max_epochs=1",
              "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=0", "checkpoint.keep_best=0"]
# float32 noise: torch.testing.assert_close's absolute tolerance, as the classification and
# segmentation invariance tests take it
NOISE_FLOOR = 1e-5

register_configs()  # the schema that conf/ builds on, as train.py registers it


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# --- the loss and the model, in this process -------------------------------------------------------

def reference_nt_xent(projections: torch.Tensor, temperature: float) -> torch.Tensor:
    """The loss as SimCLR's paper writes it (Chen et al. 2020, eq. 1), one anchor at a time, in float64:
    l(i, j) = -log(exp(sim(i, j) / t) / sum over k != i of exp(sim(i, k) / t)), averaged over the 2N
    anchors, the views 2k and 2k+1 of the paper being rows k and k + N here."""
    z = projections.double()
    n = len(z) // 2
    losses = []
    for i in range(2 * n):
        similarity = [F.cosine_similarity(z[i], z[k], dim=0) / temperature for k in range(2 * n)]
        positive = (i + n) % (2 * n)
        denominator = sum(torch.exp(similarity[k]) for k in range(2 * n) if k != i)
        losses.append(-torch.log(torch.exp(similarity[positive]) / denominator))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_nt_xent_equals_the_papers_formula_and_its_gradient(temperature):
    torch.manual_seed(0)
    projections = torch.randn(10, 7, requires_grad=True)
    loss = nt_xent(projections, temperature)
    (gradient,) = torch.autograd.grad(loss, projections)
    expected = reference_nt_xent(projections, temperature)
    (expected_gradient,) = torch.autograd.grad(expected, projections)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(gradient.double(), expected_gradient.double(), rtol=1e-4, atol=1e-7)


def test_nt_xent_computes_in_float32_under_bf16_autocast():
    torch.manual_seed(0)
    projections = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nt_xent(projections.bfloat16(), 0.5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), reference_nt_xent(projections.bfloat16().float(), 0.5), rtol=1e-5, atol=0)


def test_the_heads_go_around_the_backbone_with_clean_keys_and_the_probe_trains_on_detached_features():
    """with_heads takes small_cnn's classifier away (its features are the backbone's output) and adds
    the projector and the probe; the probe's loss reaches no backbone weight, the contrastive loss no
    probe weight."""
    torch.manual_seed(0)
    task = SimCLRTask(num_classes=10)
    model = task.with_heads(SmallCNN(num_classes=10, in_channels=1, channels=[8, 16]))
    assert {key.split(".")[0] for key in model.state_dict()} == {"backbone", "projector", "probe"}
    assert not any(key.startswith("backbone.head.3") for key in model.state_dict())  # the classifier
    assert {type(block).__name__ for block in find_blocks(model, None)} == set(SmallCNN.fsdp_block_types)  # FSDP's units
    views = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    terms = task.training_step(model, (views, torch.tensor([0, 1, 2, 3])))
    assert terms["loss"] == terms["contrastive_loss"] + terms["probe_loss"]
    terms["probe_loss"].backward(retain_graph=True)
    assert all(p.grad is None for p in [*model.backbone.parameters(), *model.projector.parameters()])
    assert all(p.grad is not None for p in model.probe.parameters())
    model.zero_grad(set_to_none=True)
    terms["contrastive_loss"].backward()
    assert all(p.grad is None for p in model.probe.parameters())
    assert all(p.grad is not None for p in model.backbone.parameters())


# --- model.weights_path with task heads, in this process ----------------------------------------------

def saved_simclr_model(path, projection_dim: int = 128) -> dict:
    torch.manual_seed(1)
    model = SimCLRTask(num_classes=10, projection_dim=projection_dim).with_heads(SmallCNN(10, 1, [8, 16]))
    torch.save({"model": model.state_dict()}, path)  # as our checkpoints hold it
    return model.state_dict()


def test_a_simclr_file_loads_its_backbone_into_a_plain_model_and_its_classifier_starts_fresh(tmp_path, caplog):
    saved = saved_simclr_model(tmp_path / "simclr.pt")
    torch.manual_seed(2)  # another initialisation: only a load gives the file's weights
    with caplog.at_level(logging.WARNING):
        model = build_model(compose_config("model.channels=[8,16]", f"model.weights_path={tmp_path / 'simclr.pt'}").model, 10, 1)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key.removeprefix("backbone.")], value) for key, value in saved.items() if key.startswith("backbone."))
    assert "skipped its heads ['probe', 'projector']" in caplog.text
    assert "the classifier ['head.3.weight', 'head.3.bias'], which the file lacks, starts from a fresh initialisation" in caplog.text
    torch.manual_seed(2)
    assert torch.equal(loaded["head.3.weight"], SmallCNN(10, 1, [8, 16]).state_dict()["head.3.weight"])  # its own init


def test_task_simclr_loads_the_heads_of_a_simclr_file_too(tmp_path):
    saved = saved_simclr_model(tmp_path / "simclr.pt")
    torch.manual_seed(2)
    cfg = compose_config("task=simclr", "model.channels=[8,16]", f"model.weights_path={tmp_path / 'simclr.pt'}")
    loaded = build_model(cfg.model, 10, 1, with_heads=SimCLRTask(num_classes=10).with_heads).state_dict()
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[key], value) for key, value in saved.items())


def test_task_simclr_starts_fresh_heads_on_a_plain_file_and_skips_a_probe_for_other_classes(tmp_path, caplog):
    """A plain model's file (no heads) loads into the backbone, the heads start fresh; a SimCLR file
    pretrained on 10 classes continues on 7: its probe's Linear is skipped and logged, the rest loads."""
    torch.manual_seed(1)
    plain = SmallCNN(10, 1, [8, 16])
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    cfg = compose_config("task=simclr", "model.channels=[8,16]", f"model.weights_path={tmp_path / 'plain.pt'}")
    with caplog.at_level(logging.INFO):
        loaded = build_model(cfg.model, 10, 1, with_heads=SimCLRTask(num_classes=10).with_heads).state_dict()
    assert "a model without task heads; the heads ['probe', 'projector'] start from a fresh initialisation" in caplog.text
    assert all(torch.equal(loaded[f"backbone.{key}"], value) for key, value in plain.state_dict().items() if "head.3" not in key)

    saved = saved_simclr_model(tmp_path / "simclr.pt")
    cfg = compose_config("task=simclr", "model.channels=[8,16]", f"model.weights_path={tmp_path / 'simclr.pt'}")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        loaded = build_model(cfg.model, 7, 1, with_heads=SimCLRTask(num_classes=7).with_heads).state_dict()
    assert "skipped the head ['probe.1.bias', 'probe.1.weight']" in caplog.text
    assert loaded["probe.1.weight"].shape == (7, 16)
    assert all(torch.equal(loaded[key], value) for key, value in saved.items() if not key.startswith("probe.1."))


def test_heads_of_another_projection_dim_are_one_line(tmp_path):
    saved_simclr_model(tmp_path / "simclr.pt", projection_dim=32)
    cfg = compose_config("task=simclr", "model.channels=[8,16]", f"model.weights_path={tmp_path / 'simclr.pt'}")
    with pytest.raises(ConfigError, match=r"its task heads do not fit this task's .*projector\.2\.weight \[32, 16\] vs \[128, 16\]") as error:
        build_model(cfg.model, 10, 1, with_heads=SimCLRTask(num_classes=10).with_heads)
    assert "\n" not in str(error.value)


# --- bad settings: one line each, before anything starts ------------------------------------------

BAD = {
    "mixup": (["data.mixup_alpha=0.2"], "data.mixup_alpha=0.2: task=simclr learns from pairs of views"),
    "cutmix": (["data.cutmix_alpha=1.0"], "data.cutmix_alpha=1.0: task=simclr learns from pairs of views"),
    "label smoothing": (["trainer.label_smoothing=0.1"], "trainer.label_smoothing=0.1: task=simclr"),
    "one view": (["data.views=1"], "data.views=1: SimCLRTask trains on 2 view(s) of each sample; set data.views=2"),
    "projection_dim": (["task.projection_dim=0"], "task.projection_dim=0: must be > 0"),
    "temperature": (["task.temperature=0"], "task.temperature=0.0: must be > 0"),
    "no classifier": (["model=small_segnet"], "task=simclr: the model (SmallSegNet) has no nn.Linear classifier with 10 outputs"),
}


@pytest.mark.parametrize("overrides, message", BAD.values(), ids=BAD.keys())
def test_bad_settings_are_one_line(overrides, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["task=simclr", "data=digits", "data.views=2", *overrides]
    assert message in config_error_in_this_process(args, tmp_path / "run")


# --- invariance: 2 ranks x 8 == 1 process x 16, only with the global negatives -------------------------

@pytest.fixture(scope="module")
def invariance(tmp_path_factory) -> dict:
    """{"single": 1 process x 16, (strategy, global_negatives): 2 ranks x 8 with SyncBN under strategy=ddp
    or fsdp, with task.global_negatives=true or false}: each run's (final weights, results, run dir). The 2-rank
    runs are one torchrun multirun; the single one is train.run in this process (a launch costs seconds
    of start-up)."""
    def produce(cwd):
        (cwd / "ranks").mkdir()
        check(launch(["-m", "strategy=ddp,fsdp", "syncbn=true", "data.batch_size=8", *INVARIANCE, "data.num_workers=2",
                      "task.global_negatives=true,false"], cwd / "ranks", nproc=2))
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process(["strategy=single", "data.batch_size=16", *INVARIANCE], cwd / "single")
        return {}

    cwd, _ = shared_run("simclr_invariance", produce, tmp_path_factory)
    (sweep_dir,) = (cwd / "ranks" / "outputs" / "multirun").iterdir()
    runs = {"single": cwd / "single"}
    for job in (path for path in sweep_dir.iterdir() if path.is_dir()):  # e.g. 1_strategy=ddp,task.global_negatives=False
        overrides = dict(override.split("=") for override in job.name.split("_", 1)[1].split(","))
        runs[overrides["strategy"], overrides["task.global_negatives"] == "True"] = job
    assert len(runs) == 5
    return {name: (final_model(run_dir), results_of(run_dir), run_dir) for name, run_dir in runs.items()}


def final_model(run_dir) -> dict:
    """The final weights: last.pt's, or those of strategy=fsdp's sharded step dir read whole (mode=eval's reader)."""
    if (run_dir / "checkpoints" / "last.pt").exists():
        return last_checkpoint(run_dir)["model"]
    (step_dir,) = (run_dir / "checkpoints").glob("step-*")
    return full_model_state(step_dir)


def max_weight_difference(weights: dict, reference: dict) -> float:
    assert weights.keys() == reference.keys()
    return max((weights[key].double() - reference[key].double()).abs().max().item() for key in reference)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_of_8_train_what_one_process_of_16_does_with_negatives_from_every_rank(invariance, strategy):
    """SyncBN normalises over both ranks' views and NT-Xent's negatives are all 32 views: the same
    model after 4 updates, and the same loss, within float32 noise (measured, DDP and FSDP alike:
    1.2e-7 in the weights, 4e-7 in the loss)."""
    (ranks, ranks_results, _), (single, single_results, _) = invariance[strategy, True], invariance["single"]
    assert (ranks_results["strategy"], ranks_results["world_size"]) == (strategy, 2)
    assert ranks_results["steps"] == single_results["steps"] == 4
    assert any(key.endswith("running_var") for key in ranks) and any(key.startswith("probe.") for key in ranks)
    worst = max_weight_difference(ranks, single)
    for key in ranks:
        torch.testing.assert_close(ranks[key], single[key], msg=lambda m, key=key: f"{key}: {m} (max difference {worst:g})")
    assert ranks_results["train_loss"] == pytest.approx(single_results["train_loss"], rel=1e-6)
    assert ranks_results["val_loss"] == pytest.approx(single_results["val_loss"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_without_the_gather_two_ranks_train_another_model(invariance, strategy):
    """task.global_negatives=false: each rank's 16 views are its only candidates, so the loss and its
    gradients differ: the weights end far above float noise from one process's (measured: 1.2e-3,
    against 1.2e-7 with the gather), which shows that the gather is what makes the runs equal."""
    (per_rank, per_rank_results, _), (single, single_results, _) = invariance[strategy, False], invariance["single"]
    assert max_weight_difference(per_rank, single) > 20 * NOISE_FLOOR
    # fewer negatives, a lower loss: about log(15) against log(31) at the start
    assert per_rank_results["train_loss"] < single_results["train_loss"] - 0.3


def test_a_sharded_simclr_checkpoint_exports_and_its_backbone_loads_into_a_plain_model(invariance, tmp_path):
    """strategy=fsdp's sharded checkpoint, exported to one file (`make export`), is what
    model.weights_path takes: its backbone.* load into a plain small_cnn."""
    (sharded,) = (invariance["fsdp", True][2] / "checkpoints").glob("step-*")
    exported = export_model(shutil.copytree(sharded, tmp_path / sharded.name))
    weights = torch.load(exported, weights_only=True)
    assert {key.split(".")[0] for key in weights} == {"backbone", "projector", "probe"}
    model = build_model(compose_config(*INVARIANCE, f"model.weights_path={exported}").model, num_classes=10, in_channels=3)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key.removeprefix("backbone.")], value) for key, value in weights.items()
               if key.startswith("backbone."))


# --- the pretraining run: the probe learns, the terms are logged ----------------------------------

@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """PRETRAIN under torchrun --nproc_per_node=2, once for all test processes: its run dir."""
    def produce(cwd) -> dict:
        check(launch(PRETRAIN, cwd, nproc=2, timeout=300))
        return {}

    cwd, _ = shared_run("simclr_pretrain", produce, tmp_path_factory)
    (run_dir,) = run_dirs(cwd)
    return run_dir


def test_the_probe_rises_well_above_chance_and_every_loss_term_is_logged(pretrained):
    """The online probe's val_accuracy (the objective) rises over the 3 epochs, to well above the 0.1 of
    chance (measured: 0.55, 0.57, 0.89)."""
    results = results_of(pretrained)
    assert (results["steps"], results["world_size"], results["replicas_identical"]) == (STEPS, 2, True)
    accumulator = EventAccumulator(str(pretrained))
    accumulator.Reload()
    accuracies = [scalar.value for scalar in accumulator.Scalars("val/accuracy")]
    assert len(accuracies) == 3 and accuracies[-1] == pytest.approx(results["val_accuracy"])
    assert accuracies[-1] > accuracies[0] and results["val_accuracy"] >= 0.7
    logged = {name: [scalar.value for scalar in accumulator.Scalars(f"train/{name}")]
              for name in ("loss", "contrastive_loss", "probe_loss")}
    assert len(logged["loss"]) == STEPS // 5 and all(len(values) == len(logged["loss"]) for values in logged.values())
    for total, contrastive, probe in zip(*logged.values()):
        assert total == pytest.approx(contrastive + probe, rel=1e-5)
    assert logged["contrastive_loss"][-1] < logged["contrastive_loss"][0]  # it learns to tell the views apart
    assert logged["contrastive_loss"][0] < math.log(2 * 32 - 1)  # at most log(63): 62 negatives and the positive


# --- mode=eval: exact at 1 and 3 ranks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated(pretrained, tmp_path_factory) -> dict:
    """mode=eval of the pretraining run's last.pt in one process (train.run in this one, with task=simclr)
    and on 3 ranks (torchrun, with no task=: the checkpoint's), neither with data.views=2: {world size: its
    results, "overrides": the 3 ranks' command line, as Hydra recorded it}."""
    def produce(cwd) -> dict:
        args = ["mode=eval", "data=digits", "data.num_workers=0", f"resume={pretrained}"]
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            one = run_in_this_process(["strategy=single", "task=simclr", *args], cwd / "1")
        (cwd / "3").mkdir()
        check(launch(["strategy=ddp", *args], cwd / "3", nproc=3, timeout=240))
        (three,) = (cwd / "3" / "outputs").rglob("eval.json")
        overrides = (three.parent / ".hydra" / "overrides.yaml").read_text()
        return {"1": one, "3": json.loads(three.read_text()), "overrides": overrides}

    _, results = shared_run("simclr_eval", produce, tmp_path_factory)
    return {"overrides": results.pop("overrides")} | {int(world_size): value for world_size, value in results.items()}


def test_mode_eval_of_the_probe_is_exact_at_1_and_3_ranks(pretrained, evaluated):
    """359 val images: the training run's 2 ranks (180 + 179), one process, 3 ranks (120 + 120 + 119)
    count each once; the probe's accuracy is a count, exactly equal; its loss a float32 sum over other
    batch groupings, equal to rounding."""
    training = results_of(pretrained)
    one, three = evaluated[1], evaluated[3]
    assert (one["world_size"], three["world_size"], one["step"], three["step"]) == (1, 3, STEPS, STEPS)
    assert one["val_samples"] == three["val_samples"] == training["val_samples"] == VAL_SAMPLES
    assert one["val_accuracy"] == three["val_accuracy"] == training["val_accuracy"]
    assert three["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    assert one["val_loss"] == pytest.approx(training["val_loss"], rel=1e-6)


def test_mode_eval_takes_the_checkpoints_task_as_its_model_and_needs_no_data_views(pretrained, evaluated):
    """`mode=eval resume=<run dir>` names no task: the model with its heads and the task are the checkpoint's,
    so the 3 ranks report the probe's val_accuracy, the training run's. Naming task=simclr (one process) needs
    no data.views=2: evaluation's samples are one view each."""
    keys = [line.removeprefix("- ").split("=")[0] for line in evaluated["overrides"].splitlines()]
    assert not [key for key in keys if key.startswith(("task", "data.views"))], keys
    assert evaluated[3]["val_accuracy"] == evaluated[1]["val_accuracy"] == results_of(pretrained)["val_accuracy"]


@pytest.mark.parametrize("task, given, trained", [
    (["task=classification"], "task._target_=tasks.classification.ClassificationTask", "task._target_=tasks.simclr.SimCLRTask"),
    (["task=simclr", "task.projection_dim=64"], "task.projection_dim=64", "task.projection_dim=128"),
], ids=["another task", "other heads"])
def test_mode_eval_with_another_task_than_the_checkpoints_names_task(task, given, trained, pretrained, tmp_path, monkeypatch):
    """A task named on the command line that builds the model with other heads than the checkpoint's (none, or
    another projection): the one line names the task's keys that differ, the keys to change, not model.* (the
    model is the checkpoint's own), and the fix."""
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process(["mode=eval", *task, "data=digits", f"resume={pretrained}"], tmp_path / "eval")
    assert line.startswith(f"{given}: "), line
    assert f"was trained with {trained}, whose heads this task's model doesn't match (" in line, line
    assert "drop task= and task.*" in line and "model.*" not in line, line


# --- resume: bit-identical, with the views' augmentation drawn from checkpointed RNGs ------------------------

def test_a_resume_from_a_mid_epoch_checkpoint_with_augmented_views_ends_bit_identical(pretrained, tmp_path):
    """A fresh torchrun launch resumed from the pretraining run's step-100 checkpoint (epoch 2, batch 10;
    each rank's RNG, from which its views' crops are drawn, as saved there) ends exactly
    where the uninterrupted run did: weights, optimizer, SyncBN buffers, position and every rank's RNG
    states. A killed rank's restart goes through the same resume (tests/test_fault_tolerance.py)."""
    step_100 = pretrained / "checkpoints" / "step-00000100.pt"
    result = launch([*PRETRAIN, f"resume={step_100}"], tmp_path, nproc=2, timeout=300)
    check(result)
    assert f"resumed from {step_100} at epoch 2, batch 10, step 100" in result.stdout
    (resumed,) = run_dirs(tmp_path)
    assert_bit_identical(last_checkpoint(resumed), last_checkpoint(pretrained))


# --- reuse: the backbone fine-tunes ---------------------------------------------------------------------

def linear_probe_accuracy(model: torch.nn.Module) -> float:
    """A logistic regression fitted on `model`'s features (its classifier's input) of the clean digits
    train split: its accuracy on the val split."""
    splits = build_digits(val_fraction=0.2, split_seed=0)
    name, _ = find_classifier(model, 10)
    features = []
    hook = model.get_submodule(name).register_forward_hook(lambda module, inputs, output: features.append(inputs[0]))
    with torch.no_grad():
        for split in (splits.train, splits.val):
            model.eval()(split.tensors[0])
    hook.remove()
    probe = LogisticRegression(max_iter=3000).fit(features[0].numpy(), splits.train.tensors[1].numpy())
    return probe.score(features[1].numpy(), splits.val.tensors[1].numpy())


def test_the_backbone_fine_tunes_through_model_weights_path_and_its_features_are_learned(pretrained, tmp_path, monkeypatch,
                                                                                          caplog):
    """task=classification model.weights_path=<the pretraining run's last.pt>: the plain small_cnn starts
    from the checkpoint's backbone (its classifier fresh), and its features separate the digits far
    better than a random backbone's (a logistic regression on each). Then
    it trains: one epoch of fine-tuning."""
    path = pretrained / "checkpoints" / "last.pt"
    pretrained_weights = last_checkpoint(pretrained)["model"]
    finetune = ["data=digits", "model.channels=[32,64]", "data.batch_size=32"]
    torch.manual_seed(0)
    model = build_model(compose_config(*finetune, f"model.weights_path={path}").model, num_classes=10, in_channels=1)
    backbone = {key.removeprefix("backbone."): value for key, value in pretrained_weights.items() if key.startswith("backbone.")}
    loaded = model.state_dict()
    assert loaded.keys() - backbone.keys() == {"head.3.weight", "head.3.bias"}
    assert all(torch.equal(loaded[key], value) for key, value in backbone.items())
    torch.manual_seed(0)
    random_backbone = build_model(compose_config(*finetune).model, num_classes=10, in_channels=1)
    learned, random = linear_probe_accuracy(model), linear_probe_accuracy(random_backbone)
    assert learned >= 0.8 and learned > random + 0.2, (learned, random)

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        results = run_in_this_process([*finetune, f"model.weights_path={path}", "trainer.max_epochs=1",
                                       "checkpoint.every_n_steps=0", "checkpoint.keep_best=0"], tmp_path / "finetune")
    assert "loaded the backbone of a model with task heads" in caplog.text
    assert results["steps"] == 45 and results["val_loss"] < math.log(10) and results["val_accuracy"] >= 0.3
