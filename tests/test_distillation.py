"""task=distillation (tasks/distillation.py): a student learns from the labels and a frozen teacher, on
2 DDP ranks (torchrun, gloo) with SyncBN, MixUp and gradient accumulation.

One teacher is trained first (in this process: small_cnn, wider than the student, on digits). Three
2-rank launches of the same student training read it: the uninterrupted reference, which most tests
read; the same run with rank 1 killed and restarted by torchrun, which must end bit-identical to it;
and strategy=fsdp, whose first 10 updates must agree with the reference's within float noise. The
other checks run in this process (the teacher's and the student's mode=eval, the loss itself, the
teacher's precision, the bad settings) or as one refused command line (a resume with another teacher).
The reference runs train.py under a small watcher (WATCHED_TRAIN) that saves each rank's teacher as
training ends, to show that it ends as it started."""

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train  # noqa: F401  (registers the config schemas and resolvers that composing a config here needs)
from conftest import (REPO, TRAIN, as_json, assert_same_weights, check, config_error_in_this_process, last_checkpoint,
                      launch, results_of, run_dirs, run_in_this_process, shared_run, shared_run_in_this_process)
from ddp.checkpoints.checkpoint import load_checkpoint
from ddp.checkpoints.sharded_checkpoint import full_model_state
from ddp.training.frozen import fingerprint, prepare_frozen
from models.small_cnn import SmallCNN
from tasks import build_task
from test_fault_tolerance import assert_bit_identical, torchrun
from test_run_dirs import file_digests

# The teacher: small_cnn 32-64 on digits (1,438 training images, 10 classes, 1 channel), 4 epochs of 45
# steps, in one process; it saves at steps 100 and 180.
TEACHER = ["strategy=single", "model.channels=[32,64]", "optim=adam", "optim.lr=0.01", "trainer.max_epochs=4",
           "checkpoint.keep_best=0"]
# The student: small_cnn 32-32, 2 ranks x 8 images x 2 micro-batches (global batch 32, 45 updates an epoch),
# SyncBN, MixUp, the LR divided by 10 for the last epoch (a step schedule: the same LR at any max_steps).
# Saves every 10 updates, all kept; logs every 5.
STUDENT = ["task=distillation", "model.channels=[32,32]", "optim=adam", "optim.lr=0.01", "scheduler=step",
           "scheduler.milestones=[3]", "data.batch_size=8", "trainer.accumulate_grad_batches=2", "data.mixup_alpha=0.2",
           "trainer.max_epochs=4", "trainer.log_every_n_steps=5", "checkpoint.every_n_steps=10", "checkpoint.keep_last=20",
           "checkpoint.keep_best=0"]
DDP = ["strategy=ddp", "syncbn=true", *STUDENT]
STUDENT_CHANNELS, TEACHER_CHANNELS, CLASSES, IN_CHANNELS = [32, 32], [32, 64], 10, 1


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The teacher's run dir (train.run in this process, once for all test processes)."""
    return shared_run_in_this_process("distillation_teacher", TEACHER, tmp_path_factory)


def composed(overrides: list[str]):
    """The config that train.py's `overrides` compose."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def ddp_args(teacher: Path) -> list[str]:
    return [*DDP, f"task.teacher={teacher}"]


# train.py's own main under torchrun, watched from outside the product code (as tests/workers/instrumented_train.py
# watches it): as each rank's training ends, the task's teacher as it is then goes into the run dir,
# teacher_rank<R>.pt. (The checkpoints record a fingerprint of the teacher as the run built it.)
WATCHED_TRAIN = """
import runpy
import sys

import torch

sys.path.insert(0, {repo!r})
import ddp.reporting.results
import ddp.training.frozen

real_prepare_frozen, real_write_results = ddp.training.frozen.prepare_frozen, ddp.reporting.results.write_results
tasks = []


def prepare_frozen(task, device):
    tasks.append(task)
    real_prepare_frozen(task, device)


def write_results(results, run_dir, env):
    real_write_results(results, run_dir, env)
    torch.save(tasks[-1].teacher.state_dict(), run_dir / f"teacher_rank{{env.rank}}.pt")


# train.py imports both by name as it runs, so it gets these
ddp.training.frozen.prepare_frozen, ddp.reporting.results.write_results = prepare_frozen, write_results
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def reference(teacher, tmp_path_factory) -> Path:
    """The student on 2 ranks under torchrun, uninterrupted, watched (WATCHED_TRAIN): its run dir."""
    def produce(cwd: Path) -> dict:
        script = cwd / "watched_train.py"
        script.write_text(WATCHED_TRAIN.format(repo=str(REPO), train=str(TRAIN)))
        result = launch(ddp_args(teacher), cwd, nproc=2, script=script)
        check(result)
        return as_json(result)

    cwd, _ = shared_run("distillation_ddp", produce, tmp_path_factory)
    (run_dir,) = run_dirs(cwd)
    return run_dir


def teacher_as_trained(teacher: Path) -> SmallCNN:
    """The teacher rebuilt from its checkpoint file by hand, without the task's code."""
    model = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=TEACHER_CHANNELS)
    model.load_state_dict(last_checkpoint(teacher)["model"])
    return model


def test_the_student_learns_and_the_teacher_stays_frozen_outside_ddp_the_optimizer_and_the_checkpoint(teacher, reference):
    """The student reaches 0.9 on digits. Each rank's teacher ends training as its checkpoint holds it,
    weights and BatchNorm statistics, and the run's checkpoints record that teacher's fingerprint; its
    tensors are not in the student's checkpoint, its parameters not in the optimizer, and DDP wrapped only
    the student's (each rank's wrapped model holds the student's parameter bytes, nothing more)."""
    results, checkpoint = results_of(reference), last_checkpoint(reference)
    assert results["val_accuracy"] >= 0.9, results

    student = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=STUDENT_CHANNELS)
    assert checkpoint["model"].keys() == student.state_dict().keys()
    parameters = list(student.parameters())
    assert [len(group["params"]) for group in checkpoint["optimizer"]["param_groups"]] == [len(parameters)]
    assert len(checkpoint["optimizer"]["state"]) == len(parameters)
    student_bytes = sum(p.numel() * p.element_size() for p in parameters)
    assert results["parameter_bytes_per_rank"] == results["gradient_bytes_per_rank"] == [student_bytes] * 2

    trained = teacher_as_trained(teacher)
    for rank in (0, 1):
        assert_same_weights(torch.load(reference / f"teacher_rank{rank}.pt", weights_only=True), trained.state_dict())
    assert checkpoint["frozen"] == {"task.teacher": fingerprint(trained)}


def test_the_loss_and_its_terms_are_in_tensorboard(reference):
    """train/loss, train/task_loss and train/kd_loss at every log step, as TensorBoard reads them, and
    loss = (1 - alpha) * task_loss + alpha * kd_loss (alpha = 0.5) at each."""
    events = EventAccumulator(str(reference))
    events.Reload()
    series = {tag: [(e.step, e.value) for e in events.Scalars(f"train/{tag}")] for tag in ("loss", "task_loss", "kd_loss")}
    assert [step for step, _ in series["loss"]] == list(range(5, 181, 5))
    assert [step for step, _ in series["task_loss"]] == [step for step, _ in series["kd_loss"]] == list(range(5, 181, 5))
    for (_, loss), (_, task_loss), (_, kd_loss) in zip(series["loss"], series["task_loss"], series["kd_loss"]):
        assert loss == pytest.approx(0.5 * task_loss + 0.5 * kd_loss, rel=1e-5)


def test_the_teachers_accuracy_is_reported_as_a_mode_eval_of_its_checkpoint_measures_it(teacher, reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evaluated = run_in_this_process(["mode=eval", f"resume={teacher}"], tmp_path / "eval")
    results = results_of(reference)
    assert results["teacher_val_accuracy"] == evaluated["val_accuracy"] > 0.9
    assert results["teacher_val_loss"] == pytest.approx(evaluated["val_loss"], rel=1e-6)
    assert "val_samples" in evaluated and "teacher_val_samples" not in results
    assert f"teacher_val_accuracy={evaluated['val_accuracy']:.4f}" in (reference / "train_rank0.log").read_text()


@pytest.mark.parametrize("task", [["task=classification"], ["task=distillation", "task.teacher={teacher}"]],
                         ids=["classification", "distillation"])
def test_mode_eval_evaluates_the_student(task, teacher, reference, tmp_path, monkeypatch):
    """The student is a plain classifier: mode=eval measures it with task=classification, or with the
    run's own task (whose teacher it loads, and doesn't use)."""
    monkeypatch.chdir(tmp_path)
    args = [arg.format(teacher=teacher) for arg in task]
    evaluated = run_in_this_process(["mode=eval", f"resume={reference}", *args], tmp_path / "eval")
    assert evaluated["val_accuracy"] == results_of(reference)["val_accuracy"]


@pytest.fixture(scope="module")
def killed_and_restarted(teacher, tmp_path_factory) -> Path:
    """The reference's run with rank 1 killed at step 15, after the step-10 checkpoint; torchrun restarts
    both ranks once. Its run dir."""
    cwd = tmp_path_factory.mktemp("distillation_killed")
    check(torchrun([*ddp_args(teacher), "fault.kill_rank=1", "fault.at_step=15"], cwd, max_restarts=1))
    (run_dir,) = run_dirs(cwd)
    return run_dir


def test_a_killed_rank_resumes_bit_identical(reference, killed_and_restarted):
    """The restart rebuilds the teacher from the task's config, checks it against the checkpoint's
    fingerprint, resumes from step 10 and ends exactly where the uninterrupted run does: model,
    optimizer, position and every rank's RNG (MixUp draws from it)."""
    log = (killed_and_restarted / "train_rank0.log").read_text()
    assert log.count("resumed from") == 1 and "at epoch 0, batch 20, step 10" in log, log[-3000:]
    final, expected = last_checkpoint(killed_and_restarted), last_checkpoint(reference)
    assert_bit_identical(final, expected)
    assert final["frozen"] == expected["frozen"]


@pytest.fixture(scope="module")
def fsdp_run(teacher, tmp_path_factory) -> Path:
    """The reference's training under strategy=fsdp for its first 10 updates: its run dir."""
    cwd = tmp_path_factory.mktemp("distillation_fsdp")
    check(launch([*ddp_args(teacher), "strategy=fsdp", "trainer.max_steps=10"], cwd, nproc=2))
    (run_dir,) = run_dirs(cwd)
    return run_dir


def test_fsdp_shards_only_the_student_and_trains_it_as_ddp_does(reference, fsdp_run):
    """After 10 updates the sharded student's weights and statistics agree with DDP's within float noise
    (gradients reduce-scattered vs all-reduced); the ranks' shards add up to the student alone; the
    teacher, unsharded on each rank, is recorded as the same one."""
    fsdp = full_model_state(fsdp_run / "checkpoints" / "step-00000010")
    ddp = load_checkpoint(reference / "checkpoints" / "step-00000010.pt")["model"]
    assert fsdp.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], msg=lambda message, key=key: f"{key}: {message}")
    student = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=STUDENT_CHANNELS)
    results = results_of(fsdp_run)
    assert sum(results["parameter_bytes_per_rank"]) == sum(p.numel() * p.element_size() for p in student.parameters())
    assert results["teacher_val_accuracy"] == results_of(reference)["teacher_val_accuracy"]
    assert load_checkpoint(fsdp_run / "checkpoints" / "step-00000010")["frozen"] == last_checkpoint(reference)["frozen"]


def test_a_sharded_checkpoint_teaches_with_the_weights_its_export_reads(fsdp_run):
    """task.teacher=<an fsdp run dir>: its newest sharded checkpoint, read whole in this one process."""
    task = build_task(composed(["task=distillation", f"task.teacher={fsdp_run}"]).task, CLASSES, None, IN_CHANNELS)
    exported = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=STUDENT_CHANNELS)
    exported.load_state_dict(full_model_state(fsdp_run / "checkpoints" / "step-00000010"))
    assert fingerprint(task.teacher) == fingerprint(exported)


def test_a_resume_with_another_teacher_is_refused_in_one_line_and_writes_nothing(teacher, reference, tmp_path):
    """The same command with the teacher's earlier checkpoint (step 100, not its last): the self-launching
    process refuses it before any worker starts, exit 1, one line, and the run dir is byte-identical."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = file_digests(run_dir)
    other = teacher / "checkpoints" / "step-00000100.pt"
    result = launch([*DDP, "strategy.nproc_per_node=2", f"task.teacher={other}", f"resume={run_dir}"], tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"error: task.teacher: differs from the run this resumes ({run_dir}/checkpoints/last.pt used another); "
                    "resume with the same task.teacher, or start a new run (resume=null)"), line
    assert "DDP workers" not in result.stdout
    assert file_digests(run_dir) == before
    assert not (tmp_path / "outputs").exists()


def test_a_teacher_named_by_its_model_config_and_weights_is_the_same_teacher(teacher):
    """`model@task.teacher_model=small_cnn task.teacher_model.channels=[32,64] task.teacher_model.weights_path=<checkpoint>`
    (docs/distillation.md's command) builds the teacher that `task.teacher=<run dir>` names: same fingerprint.
    Neither draws from the global RNG, so the student starts as with task=classification."""
    by_run_dir = composed(["task=distillation", f"task.teacher={teacher}"])
    by_config = composed(["task=distillation", "model@task.teacher_model=small_cnn", "task.teacher_model.channels=[32,64]",
                           f"task.teacher_model.weights_path={teacher}/checkpoints/last.pt"])
    torch.manual_seed(0)
    tasks = [build_task(cfg.task, CLASSES, None, IN_CHANNELS) for cfg in (by_run_dir, by_config)]
    after_building = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_building, torch.rand(3))
    assert fingerprint(tasks[0].teacher) == fingerprint(tasks[1].teacher) == fingerprint(teacher_as_trained(teacher))


def distillation_task(teacher: Path, *overrides: str):
    """The task as a run builds it from `overrides`, with its teacher prepared as the run prepares it."""
    cfg = composed(["task=distillation", f"task.teacher={teacher}", *overrides])
    task = build_task(cfg.task, CLASSES, None, IN_CHANNELS)
    prepare_frozen(task, torch.device("cpu"))
    return task


def test_the_loss_is_hintons_on_the_mixed_images_that_the_teacher_sees_too(teacher):
    """With MixUp on every batch, the teacher's input is the student's, the mixed images; the loss is
    (1 - alpha) * CE(student, mixed targets) + alpha * T^2 * KL(teacher || student) at temperature T,
    written out here from the probabilities."""
    task = distillation_task(teacher, "data.mixup_alpha=1.0", "task.alpha=0.3", "task.temperature=3.0")
    student = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=STUDENT_CHANNELS)
    seen = {}
    student.register_forward_hook(lambda module, args, output: seen.update(student_input=args[0], student_logits=output))
    task.teacher.register_forward_hook(lambda module, args, output: seen.update(teacher_input=args[0], teacher_logits=output))
    images, labels = torch.randn(8, IN_CHANNELS, 8, 8), torch.arange(8) % CLASSES
    torch.manual_seed(1)
    terms = task.training_step(student, (images, labels))
    torch.manual_seed(1)
    mixed, targets = task.train_batch(images, labels)  # the same draw
    assert seen["teacher_input"] is seen["student_input"] and torch.equal(seen["student_input"], mixed)
    assert not torch.equal(mixed, images) and targets.shape == (8, CLASSES)  # soft targets

    student_logits, teacher_logits = seen["student_logits"], seen["teacher_logits"]
    task_loss = -(targets * student_logits.log_softmax(dim=1)).sum(dim=1).mean()
    p_teacher, p_student = (teacher_logits / 3.0).softmax(dim=1), (student_logits / 3.0).softmax(dim=1)
    kd_loss = 9.0 * (p_teacher * (p_teacher.log() - p_student.log())).sum(dim=1).mean()
    torch.testing.assert_close(terms["task_loss"], task_loss)
    torch.testing.assert_close(terms["kd_loss"], kd_loss)
    torch.testing.assert_close(terms["loss"], 0.7 * task_loss + 0.3 * kd_loss)
    terms["loss"].backward()
    assert all(p.grad is not None for p in student.parameters())
    assert all(p.grad is None and not p.requires_grad for p in task.teacher.parameters())


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("16", torch.float16), ("32", torch.float32)])
def test_the_teacher_computes_at_the_runs_precision_with_or_without_the_update_steps_autocast(teacher, precision, dtype):
    """Under single, dp and ddp the update step runs training_step under autocast; under fsdp it opens
    none (FSDP's policy casts the student), and the teacher autocasts itself: at `precision` either way."""
    task = distillation_task(teacher, f"precision={precision}")
    student = SmallCNN(num_classes=CLASSES, in_channels=IN_CHANNELS, channels=STUDENT_CHANNELS)
    dtypes = []
    task.teacher.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    batch = (torch.randn(4, IN_CHANNELS, 8, 8), torch.arange(4))
    autocast_dtype = None if precision == "32" else dtype
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):  # as ddp/training/update.py
        task.training_step(student, batch)
    terms = task.training_step(student, batch)  # as under fsdp
    assert dtypes == [dtype, dtype]
    assert terms["kd_loss"].dtype == torch.float32


def test_dp_with_fp16_ema_accumulation_and_mixup_distils(teacher, reference, tmp_path, monkeypatch):
    """strategy=dp (one replica on CPU), fp16 with its GradScaler, EMA of the student: a short run
    trains, evaluates the EMA weights too, and reports the teacher as every other run does."""
    monkeypatch.chdir(tmp_path)
    results = run_in_this_process([*STUDENT, f"task.teacher={teacher}", "strategy=dp", "precision=16", "ema.decay=0.9",
                                   "trainer.max_steps=6"], tmp_path / "run")
    assert results["steps"] == 6 and torch.isfinite(torch.tensor(results["train_loss"]))
    assert "val_ema_accuracy" in results
    assert results["teacher_val_accuracy"] == results_of(reference)["teacher_val_accuracy"]
    assert last_checkpoint(tmp_path / "run")["frozen"] == last_checkpoint(reference)["frozen"]


BAD = {
    "alpha_out_of_range": (["task.teacher={teacher}", "task.alpha=1.5"],
                           "task.alpha=1.5: out of range; use a weight in [0, 1]"),
    "temperature_zero": (["task.teacher={teacher}", "task.temperature=0"],
                         "task.temperature=0.0: out of range; use a temperature > 0"),
    "no_teacher": ([], "task.teacher, task.teacher_model: neither is set; name the teacher with exactly one"),
    "two_teachers": (["task.teacher={teacher}", "model@task.teacher_model=small_cnn"],
                     "task.teacher, task.teacher_model: both are set; name the teacher with exactly one"),
    "teacher_model_by_name": (["task.teacher_model=small_cnn"],
                              "task.teacher_model=small_cnn: a model config, not a name; pick a model option with "
                              "model@task.teacher_model=small_cnn"),
    "teacher_of_other_classes": (["task.teacher={teacher}", "data=synthetic", "data.num_classes=4", "data.channels=1",
                                  "data.image_size=8"],
                                 "its weights don't fit its model built for this data (num_classes=4, in_channels=1): "
                                 "2 reshaped ['head.3.bias', 'head.3.weight']"),
    "missing_teacher": (["task.teacher={teacher}/nowhere.pt"], "task.teacher={teacher}/nowhere.pt: {teacher}/nowhere.pt: not found"),
}


@pytest.mark.parametrize("args, message", BAD.values(), ids=BAD.keys())
def test_bad_settings_are_one_line_before_anything_starts(args, message, teacher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process(["task=distillation", *(arg.format(teacher=teacher) for arg in args)],
                                        tmp_path / "run")
    assert message.format(teacher=teacher) in line, line
