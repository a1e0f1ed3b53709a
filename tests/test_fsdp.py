"""strategy=fsdp under torchrun (CPU, gloo): the same training as DDP and as one process at the global
batch, exact evaluation, and sharded checkpoints that resume bit-identically at the same world size
and with every sample trained once at another."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, TINY, TORCHRUN, check, launch, load_last, load_results, run_dirs
from ddp.checkpoint import load_checkpoint, load_latest_checkpoint
from models.small_cnn import SmallCNN
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
