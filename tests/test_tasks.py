"""The task seam (tasks.Task, docs/tasks.md), with real runs: the docs' worked example, run as written
on 2 DDP processes, learns and logs its extra terms at exactly the log steps; a model called twice
per micro-batch, with a head of the task's around it, trains under DDP as one process does at the
global batch, and under FSDP as under DDP, the backbone's blocks sharded behind the head; the extra
terms are read back to the host at log steps only; a file of a model with heads fine-tunes a plain
model, warned of exactly what is skipped; a frozen module stays on the device, in eval mode and
without gradients, outside the optimizer and the checkpoint, and a resume with another one is refused
in one line, and one the task changes stops the run at its save in one line; a training step's dict
without "loss", or with a term named like a loop scalar, is one line at the first step; a class that
isn't a Task is refused in one line.

The tasks these tests train are defined here (`test_tasks.<Class>`, importable by the runs' processes
through PYTHONPATH), with yamls in a conf dir of their own that the runs add to Hydra's search path."""

import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from conftest import (REPO, TINY, check, config_error_in_this_process, last_checkpoint, launch, results_of, run_dirs,
                      run_in_this_process, shared_run)
from ddp.training.frozen import fingerprint
from models import build_model
from models.small_cnn import SmallCNN
from tasks.classification import ClassificationTask

TASKS_PAGE = REPO / "docs" / "tasks.md"
# The processes a test launches import this module by name (the tasks' _target_). So what only the tests
# read with (DCP, TensorBoard, the other test modules, with torchvision behind them) is imported where
# they read: seconds of start-up less for each of those processes.
TESTS_ON_PATH = {"PYTHONPATH": str(REPO / "tests")}


# --- tasks of the tests' own ----------------------------------------------------------------------

class WithAuxHead(nn.Module):
    """A task's head around the model= config's model (Task.with_heads): its logits refined by an auxiliary
    head, keys backbone.* and aux.*. Like a user's, it doesn't repeat the backbone's fsdp_block_types."""

    def __init__(self, backbone: nn.Module, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.aux = nn.Sequential(nn.ReLU(), nn.Linear(num_classes, num_classes))

    def forward(self, images):
        logits = self.backbone(images)
        return logits + self.aux(logits)


class MirroredTask(ClassificationTask):
    """Two forwards of the model per micro-batch, both without randomness: the cross-entropy of the
    images and of their mirror images, averaged. Each forward's gradient counts as much as the other's.
    The model trained is the backbone with an auxiliary head (WithAuxHead)."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None):
        super().__init__(num_classes, class_names=class_names)
        self.num_classes = num_classes

    def with_heads(self, backbone):
        return WithAuxHead(backbone, self.num_classes)

    def training_step(self, model, batch):
        images, labels = batch
        ce, mirrored_ce = F.cross_entropy(model(images), labels), F.cross_entropy(model(images.flip(-1)), labels)
        return {"loss": (ce + mirrored_ce) / 2, "ce": ce, "mirrored_ce": mirrored_ce}


def random_projection(num_classes: int, seed: int) -> nn.Module:
    """A fixed random map of class probabilities to 4 values, and a dropout (so eval mode matters)."""
    linear = nn.Linear(num_classes, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(4, num_classes, generator=torch.Generator().manual_seed(seed)))
        linear.bias.zero_()
    return nn.Sequential(linear, nn.Dropout(0.5))


class FrozenProjectionTask(ClassificationTask):
    """Cross-entropy plus a penalty through a frozen random projection of the class probabilities (a
    teacher's stand-in), built from task.projection_seed. Each training step records how it finds
    the projection; every instance is kept, so a test reads the one a run in its process built."""

    built: list["FrozenProjectionTask"] = []

    def __init__(self, num_classes: int, class_names: list[str] | None = None, projection_seed: int = 0):
        super().__init__(num_classes, class_names=class_names)
        self.projection = random_projection(num_classes, projection_seed)
        self.seen: list[tuple[bool, bool, torch.device]] = []  # (training, any requires_grad, device) per step
        FrozenProjectionTask.built.append(self)

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {"task.projection_seed": self.projection}

    def training_step(self, model, batch):
        images, labels = batch
        output = model(images)
        requires_grad = any(p.requires_grad for p in self.projection.parameters())
        self.seen.append((self.projection.training, requires_grad, self.projection[0].weight.device))
        ce = F.cross_entropy(output, labels)
        penalty = self.projection(output.softmax(dim=1)).pow(2).mean()
        return {"loss": ce + penalty, "ce": ce, "penalty": penalty}


class TermsTask(ClassificationTask):
    """A training step whose dict is the cross-entropy and the extra terms named by task.terms (each the
    cross-entropy again), and holds "loss" only if task.with_loss."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None, terms: list[str] | None = None,
                 with_loss: bool = True):
        super().__init__(num_classes, class_names=class_names)
        self.terms, self.with_loss = terms or [], with_loss

    def training_step(self, model, batch):
        images, labels = batch
        ce = F.cross_entropy(model(images), labels)
        return {name: ce for name in self.terms} | ({"loss": ce} if self.with_loss else {})


class DriftingFrozenTask(FrozenProjectionTask):
    """A task that changes its frozen module in place at every step, as a teacher put back in train
    mode changes its BatchNorm statistics."""

    def training_step(self, model, batch):
        with torch.no_grad():
            self.projection[0].bias.add_(0.01)
        return super().training_step(model, batch)


class DuckTypedTask:
    """Every member a task of the old interface had, but not a tasks.Task."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None):
        self.inner = ClassificationTask(num_classes)

    def loss(self, output, targets):
        return self.inner.loss(output, targets)

    def eval_sums(self, output, targets):
        return self.inner.eval_sums(output, targets)

    def metrics(self, sums):
        return self.inner.metrics(sums)


def with_test_tasks(conf_dir: Path) -> str:
    """conf_dir/task/<name>.yaml for each task above; the override that puts conf_dir on Hydra's search path."""
    (conf_dir / "task").mkdir(parents=True, exist_ok=True)
    tasks = [("mirrored", "MirroredTask", ""), ("frozen_projection", "FrozenProjectionTask", "projection_seed: 0\n"),
             ("drifting_frozen", "DriftingFrozenTask", "projection_seed: 0\n"),
             ("terms", "TermsTask", "terms: []\nwith_loss: true\n"), ("duck_typed", "DuckTypedTask", "")]
    for name, target, options in tasks:
        (conf_dir / "task" / f"{name}.yaml").write_text(
            f"_target_: test_tasks.{target}\nobjective: val_accuracy\ndirection: maximize\n{options}")
    return f"hydra.searchpath=[file://{conf_dir}]"


# --- the docs' worked example, as written ---------------------------------------------------------

WORKED_EXAMPLE = "Worked example: consistency regularisation"


@pytest.fixture(scope="module")
def worked_example(tmp_path_factory) -> Path:
    """docs/tasks.md's worked example in a copy of the repository: its files written where their first
    lines say, its command run there (once for all test processes). The copy's dir."""
    from test_readme_examples import copy_of_repo, readme_section, run_bash_blocks, write_example

    def produce(cwd: Path) -> dict:
        section = readme_section(WORKED_EXAMPLE, page=TASKS_PAGE)
        files = write_example(section, copy_of_repo(cwd))
        run_bash_blocks(section, cwd)
        return {"files": sorted(files)}

    cwd, result = shared_run("tasks_worked_example", produce, tmp_path_factory)
    assert result["files"] == ["conf/task/consistency.yaml", "tasks/consistency.py"]  # nothing else is needed
    return cwd


def test_the_docs_worked_example_trains_on_2_ddp_processes_as_written(worked_example):
    """The two files the page shows and its command are all a user needs: the task trains and learns."""
    (run_dir,) = run_dirs(worked_example)
    results = results_of(run_dir)
    assert (results["strategy"], results["world_size"], results["epochs"]) == ("ddp", 2, 2)
    assert results["val_accuracy"] > 0.8, results  # digits: 10 classes, chance is 0.1
    assert last_checkpoint(run_dir)["config"]["task"]["_target_"] == "tasks.consistency.ConsistencyTask"


def test_extra_terms_are_in_tensorboard_at_exactly_the_log_steps(worked_example):
    """train/ce and train/consistency, as train/loss, at every trainer.log_every_n_steps-th update and
    at no other; each the same micro-batch's as the loss logged with it (loss = ce + weight x consistency)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = run_dirs(worked_example)
    config = OmegaConf.create(last_checkpoint(run_dir)["config"])
    every, steps = config.trainer.log_every_n_steps, results_of(run_dir)["steps"]
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    logged = {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
              for tag in ("train/loss", "train/ce", "train/consistency")}
    log_steps = [step for step in range(1, steps + 1) if step % every == 0]
    assert len(log_steps) >= 3
    assert {tag: sorted(values) for tag, values in logged.items()} == {tag: log_steps for tag in logged}
    for step in log_steps:
        expected = logged["train/ce"][step] + config.task.weight * logged["train/consistency"][step]
        assert logged["train/loss"][step] == pytest.approx(expected, rel=1e-5), step


# --- two forwards per micro-batch: DDP, FSDP, one process -----------------------------------------

# 2 ranks x batch 8 with SyncBN, 8 updates (one epoch); logs at even updates, so the odd ones are quiet.
MIRRORED = ["task=mirrored", "syncbn=true", *TINY, "trainer.max_epochs=1", "checkpoint.keep_best=0"]
QUIET_UPDATES = [1, 3, 5, 7]


@pytest.fixture(scope="module")
def mirrored_ddp(tmp_path_factory) -> Path:
    """MIRRORED under torchrun, 2 DDP ranks, once for all test processes: its run dir."""
    def produce(cwd: Path) -> dict:
        check(launch([with_test_tasks(cwd / "conf"), "strategy=ddp", *MIRRORED], cwd, nproc=2, env=TESTS_ON_PATH))
        return {}

    (run_dir,) = run_dirs(shared_run("tasks_mirrored_ddp", produce, tmp_path_factory)[0])
    return run_dir


@pytest.fixture(scope="module")
def mirrored_single(tmp_path_factory) -> tuple[Path, list]:
    """MIRRORED in one process at the global batch of 16 (train.run in the test process, once for all
    of them), every read of a tensor's value by the host recorded as [updates done, kind, where]
    (tests/workers/host_reads.py): (its run dir, the reads)."""
    from workers.host_reads import HostReads

    def produce(cwd: Path) -> dict:
        reads, updates = [], [0]
        counter = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: updates.__setitem__(0, updates[0] + 1))
        try:
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.chdir(cwd)
                overrides = [with_test_tasks(cwd / "conf"), "strategy=single", *MIRRORED, "data.batch_size=16"]
                with HostReads(lambda kind, where: reads.append([updates[0], kind, where])):
                    run_in_this_process(overrides, cwd / "run")
        finally:
            counter.remove()
        return {"reads": reads}

    cwd, result = shared_run("tasks_mirrored_single", produce, tmp_path_factory)
    return cwd / "run", result["reads"]


def test_two_forwards_per_micro_batch_train_2_ddp_ranks_as_one_process_at_the_global_batch(mirrored_ddp, mirrored_single):
    """DDP accepts two forwards and one backward: each rank's gradient of both forwards is averaged
    over the ranks (and SyncBN normalises each forward over both ranks' samples), so 2 ranks x 8 end
    with the weights of 1 process x 16, within float noise."""
    ddp, single = last_checkpoint(mirrored_ddp), last_checkpoint(mirrored_single[0])
    assert ddp["global_step"] == single["global_step"] == 8
    assert ddp["model"].keys() == single["model"].keys()
    for key, value in single["model"].items():
        torch.testing.assert_close(ddp["model"][key], value, msg=lambda m, key=key: f"{key}: {m}")
    assert results_of(mirrored_ddp)["replicas_identical"] is True


@pytest.fixture(scope="module")
def mirrored_fsdp(tmp_path_factory) -> Path:
    """MIRRORED under torchrun, 2 FSDP ranks, once for all test processes: its run dir."""
    def produce(cwd: Path) -> dict:
        check(launch([with_test_tasks(cwd / "conf"), "strategy=fsdp", *MIRRORED], cwd, nproc=2, env=TESTS_ON_PATH))
        return {}

    (run_dir,) = run_dirs(shared_run("tasks_mirrored_fsdp", produce, tmp_path_factory)[0])
    return run_dir


def test_two_forwards_per_micro_batch_train_under_fsdp_as_under_ddp(mirrored_ddp, mirrored_fsdp):
    """FSDP2 gathers the parameters for each forward and reduce-scatters the gradient of both after
    the backward: 2 sharded ranks end with DDP's weights, within float noise, and its val accuracy."""
    from ddp.checkpoints.sharded_checkpoint import full_model_state

    fsdp, ddp = full_model_state(mirrored_fsdp / "checkpoints" / "step-00000008"), last_checkpoint(mirrored_ddp)["model"]
    assert fsdp.keys() == ddp.keys()
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, msg=lambda m, key=key: f"{key}: {m}")
    assert results_of(mirrored_fsdp)["val_accuracy"] == results_of(mirrored_ddp)["val_accuracy"]


def test_fsdp_shards_the_backbones_blocks_behind_the_tasks_head(mirrored_fsdp):
    """WithAuxHead hides small_cnn's fsdp_block_types; FSDP finds them inside it: each Conv2d and Linear
    (small_cnn's 2 convolutions and classifier, the head's Linear) is a unit of its own, not the whole
    model one unit (0 blocks, the most memory) as before, which would also be warned of."""
    log = (mirrored_fsdp / "train_rank0.log").read_text()
    assert "fsdp: 4 block(s) sharded, then the root" in log, log
    assert "no block to shard" not in log


def test_extra_terms_read_nothing_back_to_the_host_between_log_steps(mirrored_single):
    """The terms stay on the device until a log step reads them: on the updates that neither log,
    end the epoch nor save, nothing reads a tensor's value to the host (on a GPU it would wait for
    the device every step); a log step reads them, with the loss."""
    reads = mirrored_single[1]
    assert [read for read in reads if read[0] in QUIET_UPDATES] == []
    monitor_reads = [kind for step, kind, where in reads if step == 2 and where.startswith("ddp/reporting/monitor.py")]
    assert len(monitor_reads) >= 3, reads  # train/loss, train/ce, train/mirrored_ce


# --- a file of a model with heads, into a plain model ---------------------------------------------

def test_fine_tuning_from_a_file_with_heads_warns_of_the_heads_skipped_and_nothing_else(tmp_path, caplog):
    """model.weights_path=<a file of WithAuxHead around small_cnn>, into small_cnn alone (task=classification):
    the head kept the backbone's classifier, so all of backbone.* loads, the classifier too, and only aux is
    skipped; the warning says so, and names no classifier starting fresh (task=simclr's, which takes the
    classifier away: tests/test_simclr.py)."""
    torch.manual_seed(1)
    saved = MirroredTask(num_classes=10).with_heads(SmallCNN(10, 3, [8, 16])).state_dict()
    torch.save({"model": saved}, tmp_path / "headed.pt")  # as our checkpoints hold it
    model_cfg = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "model" / "small_cnn.yaml"),
                                {"channels": [8, 16], "weights_path": str(tmp_path / "headed.pt")})
    torch.manual_seed(2)  # another initialisation: only a load gives the file's weights
    with caplog.at_level(logging.WARNING):
        loaded = build_model(model_cfg, num_classes=10, in_channels=3).state_dict()
    backbone = {key.removeprefix("backbone."): value for key, value in saved.items() if key.startswith("backbone.")}
    assert loaded.keys() == backbone.keys() and all(torch.equal(loaded[key], value) for key, value in backbone.items())
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped its heads ['aux']" in warnings[0], warnings
    assert "fresh" not in warnings[0] and "[]" not in warnings[0], warnings


# --- frozen modules -------------------------------------------------------------------------------

FROZEN = ["task=frozen_projection", "strategy=single", *TINY, "trainer.max_steps=4", "checkpoint.keep_best=0"]


def test_a_frozen_module_stays_frozen_on_the_device_and_out_of_the_optimizer_and_checkpoint(tmp_path, monkeypatch):
    """In every training step the projection is on the model's device, in eval mode (its dropout off),
    without requires_grad; after training its weights are the ones its seed gives; the checkpoint's
    model and optimizer hold the model's tensors only, and its `frozen` record the projection's fingerprint."""
    from models import build_model

    monkeypatch.chdir(tmp_path)
    FrozenProjectionTask.built.clear()
    run_in_this_process([with_test_tasks(tmp_path / "conf"), *FROZEN], tmp_path / "run")
    (task,) = FrozenProjectionTask.built
    assert len(task.seen) == 4 and set(task.seen) == {(False, False, torch.device("cpu"))}, task.seen
    fresh = random_projection(10, seed=0)
    for key, value in fresh.state_dict().items():
        assert torch.equal(task.projection.state_dict()[key], value), key

    checkpoint = last_checkpoint(tmp_path / "run")
    model = build_model(OmegaConf.create(checkpoint["config"]).model, num_classes=10, in_channels=3)
    assert checkpoint["model"].keys() == model.state_dict().keys()
    optimized = [index for group in checkpoint["optimizer"]["param_groups"] for index in group["params"]]
    assert len(optimized) == len(list(model.parameters()))
    assert checkpoint["frozen"] == {"task.projection_seed": fingerprint(fresh)}


def test_a_resume_with_another_frozen_module_is_refused_in_one_line_leaving_the_run_dir_as_it_was(tmp_path, monkeypatch):
    """`python train.py ... resume=<run dir> task.projection_seed=1`: the projection the task builds
    differs from the one the run trained with; one `error:` line naming the key, exit 1, and every
    file of the run dir as it was."""
    from test_run_dirs import file_digests

    monkeypatch.chdir(tmp_path)
    search_path = with_test_tasks(tmp_path / "conf")
    run_dir = tmp_path / "run"
    run_in_this_process([search_path, *FROZEN, "trainer.max_steps=2"], run_dir)
    before = file_digests(run_dir)

    result = launch([search_path, *FROZEN, "task.projection_seed=1", f"resume={run_dir}"], tmp_path, env=TESTS_ON_PATH)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"error: task.projection_seed: differs from the run this resumes ({run_dir}/checkpoints/last.pt used "
                    "another); resume with the same task.projection_seed, or start a new run (resume=null)"), line
    assert file_digests(run_dir) == before


def test_a_frozen_module_the_task_changes_stops_the_run_at_the_save_in_one_line(tmp_path):
    """The checkpoint records the frozen modules' fingerprints, and a resume rebuilds them from the config:
    a task that changes one in place (here its bias, at every step) is stopped at the first save with one
    line naming its key, rather than saving a checkpoint that no resume could continue."""
    result = launch([with_test_tasks(tmp_path / "conf"), *FROZEN, "task=drifting_frozen", "checkpoint.every_n_steps=2"],
                    tmp_path, env=TESTS_ON_PATH)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: task.projection_seed: the frozen module changed during training (at step 2 it differs from the run's "
        "start, which a resume rebuilds from the config); DriftingFrozenTask must not modify it (no .train(), no "
        "in-place update)"]
    (run_dir,) = run_dirs(tmp_path)
    assert not any((run_dir / "checkpoints").glob("step-*"))


# --- the training step's dict ---------------------------------------------------------------------

@pytest.mark.parametrize("terms, with_loss, error", [
    (["ce", "aux"], False, 'training_step returned a dict without "loss" (keys [\'aux\', \'ce\']); put the loss to '
                           'back-propagate under "loss", extra terms beside it (docs/tasks.md)'),
    (["ce", "lr", "grad_norm"], True, "training_step's extra term(s) ['grad_norm', 'lr'] would be logged over the loop's "
                                      "own train/<name> scalars (epoch_loss, epoch_time_s, grad_norm, loss, lr, "
                                      "samples_per_s, samples_per_s_per_rank); rename them"),
])
def test_a_training_step_dict_without_loss_or_with_a_loop_scalars_name_is_one_line_at_the_first_step(
        tmp_path, monkeypatch, terms, with_loss, error):
    """A dict without "loss" has nothing to back-propagate, and a term named like a scalar the loop logs
    (train/lr, train/grad_norm, ...) would be logged over it: one line naming task._target_, at the first step."""
    from ddp.config.schema import ConfigError

    monkeypatch.chdir(tmp_path)
    overrides = [with_test_tasks(tmp_path / "conf"), "task=terms", f"task.terms={terms}", f"task.with_loss={with_loss}",
                 *TINY, "trainer.max_steps=2"]
    with pytest.raises(ConfigError) as raised:
        run_in_this_process(overrides, tmp_path / "run")
    assert str(raised.value) == f"task._target_=test_tasks.TermsTask: {error}"
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- not a task -----------------------------------------------------------------------------------

def test_a_class_that_is_not_a_task_is_refused_in_one_line(tmp_path, monkeypatch):
    """A class with the old duck-typed members but no tasks.Task base: one line naming task._target_,
    before anything starts (a Task's defaults, training_step above all, are what the loop calls)."""
    monkeypatch.chdir(tmp_path)
    overrides = [with_test_tasks(tmp_path / "conf"), "task=duck_typed", *TINY]
    line = config_error_in_this_process(overrides, tmp_path / "outputs" / "run")
    assert line == "task._target_=test_tasks.DuckTypedTask: not a task; subclass tasks.Task (docs/tasks.md)"
