"""strategy=fsdp under torchrun (CPU, gloo): the same training as DDP and as one process at the global
batch, exact evaluation, and sharded checkpoints that resume bit-identically at the same world size
and with every sample trained once at another."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, TINY, TORCHRUN, check, launch, load_last, load_results, run_dirs
from ddp.checkpoint import load_checkpoint, load_latest_checkpoint
from models.small_cnn import SmallCNN
from models.weights import load_weights
from test_elastic import records
from test_fault_tolerance import assert_same_state, torchrun

# DDP_RUN's training (conftest: 2 ranks x batch 8 with SyncBN, 16 steps) under fsdp, saving every 5
# steps (the last 3 kept: 10, 15, 16), each rank recording the samples it trains.
FSDP_RUN = ["strategy=fsdp", "syncbn=true", *TINY, "checkpoint.keep_best=0", "checkpoint.every_n_steps=5",
            "fault.record_samples_dir=samples"]
SAMPLES = 128


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """FSDP_RUN under torchrun --nproc_per_node=2: its cwd."""
    cwd = tmp_path_factory.mktemp("fsdp")
    check(launch(FSDP_RUN, cwd, nproc=2))
    return cwd


def step_dir(cwd: Path, step: int) -> Path:
    (run_dir,) = run_dirs(cwd)
    return run_dir / "checkpoints" / f"step-{step:08d}"


def full_state(checkpoint: Path, tmp: Path) -> dict:
    """A sharded checkpoint's model and optimizer states as full tensors, by torch's own converter."""
    dcp_to_torch_save(checkpoint, tmp / "full.pt")
    return torch.load(tmp / "full.pt", weights_only=True)


def test_fsdp_trains_as_ddp_and_one_process_with_the_global_batch(fsdp_run, ddp_run, single_run, tmp_path):
    """Gradients reduce-scattered over gloo average as DDP's all_reduce does: the final weights of the
    three agree within float noise, and evaluation (the sharded model's forward, every sample once)
    reports DDP's metrics."""
    fsdp = full_state(step_dir(fsdp_run, 16), tmp_path)["model"]
    for other in (load_last(ddp_run[0])["model"], load_last(single_run[0])["model"]):
        assert fsdp.keys() == other.keys() and any(key.endswith("running_var") for key in fsdp)
        for key in other:
            torch.testing.assert_close(fsdp[key], other[key], msg=lambda m, key=key: f"{key}: {m}")
    results, ddp = load_results(fsdp_run), load_results(ddp_run[0])
    assert (results["strategy"], results["world_size"], results["steps"], results["global_batch_size"]) == ("fsdp", 2, 16, 16)
    assert results["val_samples"] == ddp["val_samples"] == 37
    assert results["val_accuracy"] == ddp["val_accuracy"]
    assert results["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    assert results["replicas_identical"] is True


def test_sharded_checkpoints_are_step_dirs_with_the_last_kept(fsdp_run):
    """One DCP dir per save (one shard file per rank), the newest checkpoint.keep_last kept, no temp dir
    left; rank 0's state.pt loads with weights_only and holds every rank's RNG and loader state."""
    checkpoints = step_dir(fsdp_run, 16).parent
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000010", "step-00000015", "step-00000016"]
    files = sorted(p.name for p in step_dir(fsdp_run, 16).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    state = load_checkpoint(step_dir(fsdp_run, 16))
    assert state["sharded"] is True and "model" not in state and "optimizer" not in state
    assert (state["epoch"], state["global_step"], state["world_size"], len(state["ranks"])) == (2, 16, 2, 2)
    assert not torch.equal(state["ranks"][0]["loader_rng"], state["ranks"][1]["loader_rng"])  # each rank's own


def test_resume_auto_takes_the_newest_complete_sharded_checkpoint(fsdp_run, tmp_path):
    """A step dir without DCP's index (a save that never finished) is skipped, and so is a temp dir."""
    run_dir = tmp_path / "run"
    shutil.copytree(step_dir(fsdp_run, 16).parent, run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step-00000016" / ".metadata").unlink()
    shutil.copytree(run_dir / "checkpoints" / "step-00000015", run_dir / "checkpoints" / ".step-00000017.tmp")
    path, state = load_latest_checkpoint(run_dir)
    assert (path.name, state["global_step"]) == ("step-00000015", 15)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> tuple[Path, str]:
    """FSDP_RUN with rank 1 killed at step 7, one torchrun restart: (cwd, rank 0's log)."""
    cwd = tmp_path_factory.mktemp("fsdp_killed")
    result = torchrun([*FSDP_RUN, "fault.kill_rank=1", "fault.at_step=7"], cwd, max_restarts=1)
    check(result)
    (run_dir,) = run_dirs(cwd)
    return cwd, (run_dir / "train_rank0.log").read_text()


def test_killed_rank_resumes_from_the_sharded_checkpoint_bit_identical(fsdp_run, killed_and_resumed, tmp_path):
    cwd, log = killed_and_resumed
    assert re.findall(r"resumed from (\S+) at epoch 0, batch 5, step 5", log) == [str(step_dir(cwd, 5))], log
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert_same_state(full_state(step_dir(cwd, 16), tmp_path / "a"), full_state(step_dir(fsdp_run, 16), tmp_path / "b"))
    resumed, uninterrupted = load_checkpoint(step_dir(cwd, 16)), load_checkpoint(step_dir(fsdp_run, 16))
    for state in (resumed, uninterrupted):
        for rank in state["ranks"]:
            del rank["python_rng"]  # `seed` doesn't seed it (tests/test_fault_tolerance.py)
    for key in ("epoch", "global_step", "ranks", "optimizer_param_groups", "scheduler"):
        assert_same_state(resumed[key], uninterrupted[key], key)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_another_world_size_trains_every_sample_once(fsdp_run, tmp_path, world_size):
    """Saved by 2 ranks at step 10 (epoch 1, 2 batches in), resumed by 1 or 3: DCP reshards the model
    and optimizer, and the rest of epoch 1 holds exactly the samples the checkpoint hadn't trained. The
    resumed run's best validation is kept as best/ (checkpoint.keep_best=1, the default)."""
    result = launch(["strategy=fsdp", "syncbn=true", *TINY, f"resume={step_dir(fsdp_run, 10)}",
                     "fault.record_samples_dir=resumed"], tmp_path, nproc=world_size)
    check(result)
    assert f"checkpoint has world_size=2, this run {world_size}" in result.stdout
    kept = [i for r in records(fsdp_run / "samples", attempt=0) if r["epoch"] == 1 and r["step"] <= 10 for i in r["ids"]]
    rest = [i for r in records(tmp_path / "resumed", attempt=0) if r["epoch"] == 1 for i in r["ids"]]
    assert len(kept) == 2 * 16 and sorted(kept + rest) == list(range(SAMPLES))
    (run_dir,) = run_dirs(tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["val_samples"] == 37
    best = load_checkpoint(run_dir / "checkpoints" / "best")
    assert (best["global_step"], best["world_size"]) == (results["best_step"], world_size)


def test_every_rank_starts_from_the_same_weights(tmp_path):
    """FSDP keeps each rank's slice of its own init (pytorch#148756): the full weights that 2 ranks'
    shards make up are those of the model built in one process with the seed; a model whose init
    depends on the rank is refused on every rank before it is sharded."""
    result = subprocess.run([str(TORCHRUN), "--nproc_per_node=2", str(REPO / "tests" / "workers" / "fsdp_init.py"), str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    check(result)
    torch.manual_seed(0)
    one_process = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).state_dict()
    assert_same_state(torch.load(tmp_path / "full.pt", weights_only=True), one_process)
    for rank in (0, 1):
        assert "the ranks built different initial weights" in (tmp_path / f"refusal_rank{rank}.txt").read_text()


def test_each_rank_holds_about_half_of_ddps_parameters_gradients_and_optimizer_state(fsdp_run, ddp_run):
    """results.json's per-rank bytes, from the tensors each rank holds: under DDP every rank the whole
    model, its gradients and its momentum buffers; under fsdp on 2 ranks at most 55% of that each,
    and the shards together at least the whole."""
    fsdp, ddp = load_results(fsdp_run), load_results(ddp_run[0])
    model_bytes = 4 * sum(p.numel() for p in SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).parameters())
    for kind in ("parameter", "gradient", "optimizer_state"):  # SGD with momentum: one buffer per parameter
        assert ddp[f"{kind}_bytes_per_rank"] == [model_bytes, model_bytes], kind
        shards = fsdp[f"{kind}_bytes_per_rank"]
        assert len(shards) == 2 and all(0 < rank <= 0.55 * model_bytes for rank in shards) and sum(shards) >= model_bytes, kind


def test_export_writes_one_plain_state_dict_for_the_bare_model_and_weights_path(fsdp_run, tmp_path):
    """`make export CKPT=<step dir>` (python -m ddp.export) writes <dir>/model.pt: the full weights,
    loading with weights_only=True into the unwrapped model, and through model.weights_path."""
    checkpoint = shutil.copytree(step_dir(fsdp_run, 16), tmp_path / "step-00000016")
    assert f"-m ddp.export {checkpoint}" in subprocess.run(["make", "-n", "export", f"CKPT={checkpoint}"], cwd=REPO,
                                                            capture_output=True, text=True).stdout
    result = subprocess.run([sys.executable, "-m", "ddp.export", str(checkpoint)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    check(result)
    exported = torch.load(checkpoint / "model.pt", weights_only=True)
    (tmp_path / "full").mkdir()
    assert_same_state(exported, full_state(step_dir(fsdp_run, 16), tmp_path / "full")["model"])  # torch's own converter
    SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).load_state_dict(exported, strict=True)
    model = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16])
    load_weights(model, str(checkpoint / "model.pt"), num_classes=10)
    assert_same_state(model.state_dict(), exported)


def test_eval_of_a_sharded_checkpoint_in_one_process_reports_the_training_runs_metrics(fsdp_run, tmp_path):
    """mode=eval reads fsdp's sharded checkpoint whole: one process without a process group reports
    the metrics that 2 fsdp ranks validated at the same step."""
    data = [arg for arg in TINY if arg.startswith("data")]
    check(launch(["mode=eval", "strategy=single", *data, f"resume={step_dir(fsdp_run, 16)}"], tmp_path))
    (run_dir,) = run_dirs(tmp_path)
    evaluated, training = json.loads((run_dir / "eval.json").read_text()), load_results(fsdp_run)
    assert (evaluated["world_size"], evaluated["step"], evaluated["val_samples"]) == (1, 16, 37)
    assert evaluated["val_accuracy"] == training["val_accuracy"]
    assert evaluated["val_loss"] == pytest.approx(training["val_loss"], rel=1e-6)  # float32 sums over other batch groupings


# Accumulation and clipping: 2 ranks x 2 micro-batches of 4 under fsdp, against one process at the
# global batch of 16. GroupNorm, so micro-batching doesn't change the forward; a clip norm below the
# gradients' (train/grad_norm shows it), so every update is clipped.
ACCUMULATED = [*TINY, "model.norm=group", "trainer.max_epochs=1", "trainer.gradient_clip_norm=0.05"]


def test_accumulation_and_clipping_under_fsdp_train_as_one_process(tmp_path):
    runs = {"fsdp": tmp_path / "fsdp", "single": tmp_path / "single"}
    for cwd in runs.values():
        cwd.mkdir()
    check(launch(["strategy=fsdp", *ACCUMULATED, "data.batch_size=4", "trainer.accumulate_grad_batches=2"], runs["fsdp"], nproc=2))
    check(launch(["strategy=single", *ACCUMULATED, "data.batch_size=16"], runs["single"]))
    fsdp = full_state(step_dir(runs["fsdp"], 8), tmp_path)["model"]
    single = load_last(runs["single"])["model"]
    assert fsdp.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(fsdp[key], single[key], msg=lambda m, key=key: f"{key}: {m}")
    norms = {}
    for name, cwd in runs.items():
        accumulator = EventAccumulator(str(run_dirs(cwd)[0]))
        accumulator.Reload()
        norms[name] = [(event.step, event.value) for event in accumulator.Scalars("train/grad_norm")]
    assert [step for step, _ in norms["fsdp"]] == [2, 4, 6, 8] and all(norm > 0.05 for _, norm in norms["fsdp"])
    assert [norm for _, norm in norms["fsdp"]] == pytest.approx([norm for _, norm in norms["single"]], rel=1e-4)
