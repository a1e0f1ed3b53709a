"""strategy=fsdp under torchrun (CPU, gloo): the same training as DDP and as one process at the global
batch, for both tasks, with SUM reduce-scatters on gloo; exact evaluation, on ranks holding unequal
numbers of val batches; sharded checkpoints that hold rank 0's buffers, resume bit-identically at the
same world size and with every sample trained once at another, and whose loading runs no pickled code;
mixed precision through FSDP's policy, in a sweep, with an inf on one rank's fp16 gradient shard
skipping the update on every rank; the whole model as one unit. Runs that several tests read are
shared by the test processes (conftest.shared_run); the one-process sides run in the test process."""

import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.utils.data import DataLoader

from conftest import (REPO, TINY, TORCHRUN, as_json, assert_no_process_group_left_at_exit, check,
                      config_error_in_this_process, exit_watch, last_checkpoint, launch, load_last, load_results,
                      results_of, run_dirs, run_in_this_process, shared_run)
from ddp.checkpoints.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint
from ddp.checkpoints.export import export_model
from ddp.checkpoints.sharded_checkpoint import full_model_state
from ddp.loading.samplers import ShardSampler, most_shard_batches
from models.small_cnn import SmallCNN
from models.weights import load_weights
from test_elastic import records
from test_fault_tolerance import _CreatesFileWhenUnpickled, assert_same_state, torchrun
from test_segmentation_runs import GRID, LEARN, learned  # noqa: F401, F811 (learned: a fixture)
from test_sweeps import assert_one_run_per_job_dir, job_dirs, shared_sweep, summary_rows, the_sweep_dir
from workers import fsdp_init as fsdp_worker

# DDP_RUN's training (conftest: 2 ranks x batch 8 with SyncBN, 16 steps) under fsdp, saving every 5
# steps (the last 3 kept: 10, 15, 16), each rank recording the samples it trains. Validation at batch 6
# splits the 37 val samples 19/18 into 4 and 3 batches, so rank 1 runs a forward that counts for
# nothing (each forward gathers parameters from every rank); a rank left waiting fails the run within
# strategy.timeout_s.
FSDP_RUN = ["strategy=fsdp", "syncbn=true", *TINY, "checkpoint.keep_best=0", "checkpoint.every_n_steps=5",
            "fault.record_samples_dir=samples", "data.val_batch_size=6", "strategy.timeout_s=60"]
SAMPLES = 128
TINY_DATA = [arg for arg in TINY if arg.startswith("data")]
INSTRUMENTED = REPO / "tests" / "workers" / "instrumented_train.py"


def run_fsdp(cwd: Path) -> dict:
    check(launch(FSDP_RUN, cwd, nproc=2, env=exit_watch(cwd)))
    return {}


@pytest.fixture
def fsdp_run(tmp_path_factory) -> Path:
    """FSDP_RUN under torchrun --nproc_per_node=2, once for all test processes: its cwd."""
    return shared_run("fsdp_run", run_fsdp, tmp_path_factory)[0]


def test_fsdp_ranks_exit_with_no_process_group_left(fsdp_run):
    """FSDP's device mesh stays in DTensor's caches for the life of the process, and with it the group."""
    assert_no_process_group_left_at_exit(fsdp_run)


def step_dir(cwd: Path, step: int) -> Path:
    (run_dir,) = run_dirs(cwd)
    return run_dir / "checkpoints" / f"step-{step:08d}"


def full_state(checkpoint: Path, tmp: Path) -> dict:
    """A sharded checkpoint's model and optimizer states as full tensors, by torch's own converter (via tmp)."""
    tmp.mkdir(exist_ok=True)
    dcp_to_torch_save(checkpoint, tmp / "full.pt")
    return torch.load(tmp / "full.pt", weights_only=True)


def test_fsdp_trains_as_ddp_and_one_process_with_the_global_batch(fsdp_run, ddp_run, single_run, tmp_path):
    """Gradients reduce-scattered over gloo average as DDP's all_reduce does: the final weights of the
    three agree within float noise, and evaluation (the sharded model's forward, every sample once, on
    ranks holding 4 and 3 val batches) reports DDP's metrics."""
    fsdp = full_state(step_dir(fsdp_run, 16), tmp_path)["model"]
    for other in (load_last(ddp_run[0])["model"], last_checkpoint(single_run)["model"]):
        assert fsdp.keys() == other.keys() and any(key.endswith("running_var") for key in fsdp)
        for key in other:
            torch.testing.assert_close(fsdp[key], other[key], msg=lambda m, key=key: f"{key}: {m}")
    results, ddp = load_results(fsdp_run), load_results(ddp_run[0])
    assert (results["strategy"], results["world_size"], results["steps"], results["global_batch_size"]) == ("fsdp", 2, 16, 16)
    assert results["val_samples"] == ddp["val_samples"] == 37
    assert results["val_accuracy"] == ddp["val_accuracy"]
    assert results["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    assert results["replicas_identical"] is True


@pytest.mark.parametrize("size, world_size, batch_size, limit_batches",
                         [(37, 2, 6, -1), (37, 2, 6, 3), (17, 2, 8, -1), (2, 3, 1, -1), (37, 3, 8, 1)])
def test_every_rank_knows_how_many_val_forwards_the_busiest_rank_runs(size, world_size, batch_size, limit_batches):
    """Under fsdp a rank with fewer val batches runs forwards that count for nothing up to
    most_shard_batches, which each rank computes alone: the most batches any rank's val loader yields
    within trainer.limit_val_batches; an empty shard evaluates one zero batch."""
    loaders = [DataLoader(range(size), batch_size=batch_size, sampler=ShardSampler(size, world_size, rank))
               for rank in range(world_size)]
    batches = [len(loader) if limit_batches == -1 else min(len(loader), limit_batches) for loader in loaders]
    assert most_shard_batches(size, world_size, batch_size, limit_batches) == max(*batches, 1)


def test_sharded_checkpoints_are_step_dirs_with_the_last_kept(fsdp_run):
    """One DCP dir per save (one shard file per rank), the newest checkpoint.keep_last kept, no temp dir
    left; rank 0's state.pt loads with weights_only and holds every rank's RNG state."""
    checkpoints = step_dir(fsdp_run, 16).parent
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000010", "step-00000015", "step-00000016"]
    files = sorted(p.name for p in step_dir(fsdp_run, 16).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "digests.json", "state.pt"]
    state = load_checkpoint(step_dir(fsdp_run, 16))
    assert state["sharded"] is True and "model" not in state and "optimizer" not in state
    assert (state["epoch"], state["global_step"], state["world_size"], len(state["ranks"])) == (2, 16, 2, 2)
    assert not torch.equal(state["ranks"][0]["torch_rng"], state["ranks"][1]["torch_rng"])  # each rank's own


def test_resume_auto_takes_the_newest_complete_sharded_checkpoint(fsdp_run, tmp_path):
    """A step dir without DCP's index (a save that never finished) is skipped, and so is a temp dir."""
    run_dir = tmp_path / "run"
    shutil.copytree(step_dir(fsdp_run, 16).parent, run_dir / "checkpoints")
    (run_dir / "checkpoints" / "step-00000016" / ".metadata").unlink()
    shutil.copytree(run_dir / "checkpoints" / "step-00000015", run_dir / "checkpoints" / ".step-00000017.tmp")
    path, state = load_latest_checkpoint(run_dir)
    assert (path.name, state["global_step"]) == ("step-00000015", 15)


def test_a_bit_flipped_in_a_sharded_checkpoints_file_is_caught_and_resume_auto_takes_the_one_before(fsdp_run, tmp_path, caplog):
    """Each rank hashed the shards it wrote into digests.json: a bit flipped at random offsets of either rank's
    shard file or of state.pt is refused as corrupt, by resume's loading and by the whole-model read of mode=eval
    and the export; resume=auto takes step 15 instead. Without a manifest (saved before digests), the dir loads and
    the log says it is unverified."""
    from test_integrity import SEED, flip_bit

    rng = random.Random(SEED)
    for name in ("__0_0.distcp", "__1_0.distcp", "state.pt"):
        for _ in range(3):
            flipped = shutil.copytree(step_dir(fsdp_run, 16), tmp_path / "flipped" / "step-00000016")
            flip_bit(flipped / name, rng.randrange((flipped / name).stat().st_size), rng.randrange(8))
            with pytest.raises(CheckpointError, match=rf"^{flipped}: corrupt, {re.escape(name)} fails its CRC-32 check"):
                load_checkpoint(flipped)
            with pytest.raises(CheckpointError, match=rf"^{flipped}: corrupt, {re.escape(name)}"):
                full_model_state(flipped)
            shutil.rmtree(flipped.parent)
    run_dir = tmp_path / "run"
    shutil.copytree(step_dir(fsdp_run, 16).parent, run_dir / "checkpoints")
    flip_bit(run_dir / "checkpoints" / "step-00000016" / "__1_0.distcp", 100, 2)
    with caplog.at_level("INFO"):
        path, state = load_latest_checkpoint(run_dir)
    assert (path.name, state["global_step"]) == ("step-00000015", 15)
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'step-00000016'}: corrupt, __1_0.distcp fails" in caplog.text
    unlisted = shutil.copytree(step_dir(fsdp_run, 15), tmp_path / "before-digests" / "step-00000015")
    (unlisted / "digests.json").unlink()
    caplog.clear()
    with caplog.at_level("INFO"):
        assert load_checkpoint(unlisted)["global_step"] == 15
    assert f"{unlisted} carries no digest, so it loads unverified" in caplog.text


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
    assert_same_state(full_state(step_dir(cwd, 16), tmp_path / "a"), full_state(step_dir(fsdp_run, 16), tmp_path / "b"))
    resumed, uninterrupted = load_checkpoint(step_dir(cwd, 16)), load_checkpoint(step_dir(fsdp_run, 16))
    for state in (resumed, uninterrupted):
        for rank in state["ranks"]:
            del rank["python_rng"]  # `seed` doesn't seed it (tests/test_fault_tolerance.py)
    for key in ("epoch", "global_step", "ranks", "optimizer_param_groups", "scheduler"):
        assert_same_state(resumed[key], uninterrupted[key], key)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_another_world_size_trains_every_sample_once(fsdp_run, tmp_path, world_size, monkeypatch):
    """Saved by 2 ranks at step 10 (epoch 1, 2 batches in), resumed by 1 or 3: DCP reshards the model
    and optimizer, and the rest of epoch 1 holds exactly the samples the checkpoint hadn't trained. The
    resumed run's best validation is kept as best/ (checkpoint.keep_best=1, the default). At 3 ranks
    the launch is a multirun whose second job evaluates the same checkpoint (mode=eval under fsdp):
    it reports exactly what one process evaluating it reports."""
    checkpoint = step_dir(fsdp_run, 10)
    args = ["strategy=fsdp", "syncbn=true", *TINY, f"resume={checkpoint}", "fault.record_samples_dir=resumed"]
    result = launch(["-m", *args, "mode=train,eval"] if world_size == 3 else args, tmp_path, nproc=world_size)
    check(result)
    assert f"checkpoint has world_size=2, this run {world_size}" in result.stdout
    kept = [i for r in records(fsdp_run / "samples", attempt=0) if r["epoch"] == 1 and r["step"] <= 10 for i in r["ids"]]
    rest = [i for r in records(tmp_path / "resumed", attempt=0) if r["epoch"] == 1 for i in r["ids"]]
    assert len(kept) == 2 * 16 and sorted(kept + rest) == list(range(SAMPLES))
    run_dir = job_dirs(the_sweep_dir(tmp_path))[0] if world_size == 3 else run_dirs(tmp_path)[0]
    results = results_of(run_dir)
    assert results["val_samples"] == 37
    best = load_checkpoint(run_dir / "checkpoints" / "best")
    assert (best["global_step"], best["world_size"]) == (results["best_step"], world_size)
    if world_size == 3:
        evaluated = json.loads((job_dirs(the_sweep_dir(tmp_path))[1] / "eval.json").read_text())
        monkeypatch.chdir(tmp_path)
        one_process = run_in_this_process(["mode=eval", "strategy=single", *TINY_DATA, f"resume={checkpoint}"], tmp_path / "eval")
        assert (evaluated["strategy"], evaluated["world_size"], evaluated["step"], evaluated["val_samples"]) == ("fsdp", 3, 10, 37)
        assert evaluated["val_accuracy"] == one_process["val_accuracy"]
        assert evaluated["val_loss"] == pytest.approx(one_process["val_loss"], rel=1e-6)


def run_fsdp_parts(out: Path) -> dict:
    result = subprocess.run([str(TORCHRUN), "--nproc_per_node=2", str(REPO / "tests" / "workers" / "fsdp_init.py"), str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    check(result)
    return {}


@pytest.fixture
def fsdp_parts(tmp_path_factory) -> Path:
    """tests/workers/fsdp_init.py on 2 ranks, once for all test processes: the dir it wrote to."""
    return shared_run("fsdp_parts", run_fsdp_parts, tmp_path_factory)[0]


def test_every_rank_starts_from_the_same_weights_and_bf16_keeps_batchnorm_in_float32(fsdp_parts):
    """FSDP keeps each rank's slice of its own init (pytorch#148756): the full weights that 2 ranks'
    shards make up are those of the model built in one process with the seed; a model whose init
    depends on the rank is refused on every rank before it is sharded."""
    torch.manual_seed(0)
    one_process = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).state_dict()
    assert_same_state(torch.load(fsdp_parts / "full.pt", weights_only=True), one_process)
    for rank in (0, 1):
        assert "the ranks built different initial weights" in (fsdp_parts / f"refusal_rank{rank}.txt").read_text()
    # precision=bf16 (MixedPrecisionPolicy): convolutions compute in bf16, BatchNorm in float32, the
    # output (and so the loss) is float32, and the sharded parameters stay float32
    assert json.loads((fsdp_parts / "bf16_dtypes.json").read_text()) == {
        "parameters": ["torch.float32"], "model_output": "torch.float32",
        "conv": {"input": "torch.bfloat16", "weight": "torch.bfloat16"},
        "batchnorm": {"input": "torch.float32", "weight": "torch.float32"},
    }


def test_empty_block_types_shard_the_whole_model_as_one_unit_that_trains_as_one_process(fsdp_parts):
    """strategy.block_types=[]: the root is the only FSDP unit, and one SGD step of 2 ranks on the same
    batch ends where one process's step on it does."""
    assert json.loads((fsdp_parts / "root_alone.json").read_text()) == {"units": [""]}
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16])
    images, targets = fsdp_worker.batch(1)
    torch.nn.functional.cross_entropy(model(images), targets).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    sharded = torch.load(fsdp_parts / "root_alone.pt", weights_only=True)
    assert sharded.keys() == model.state_dict().keys()
    for key, expected in model.state_dict().items():
        torch.testing.assert_close(sharded[key], expected, msg=lambda m, key=key: f"{key}: {m}")


def test_a_model_in_which_no_block_is_found_is_warned_of_naming_strategy_block_types(fsdp_parts):
    """No fsdp_block_types, no module of a known family, no timm blocks: the root is the one unit, gathered
    whole for every forward (the most memory), and a warning says so, naming the key that names the blocks;
    strategy.block_types=[], which asks for that, is not warned of."""
    warnings = json.loads((fsdp_parts / "unit_warnings.json").read_text())
    assert len(warnings["found_none"]) == 1, warnings
    assert "no block to shard found in Sequential" in warnings["found_none"][0] and "strategy.block_types=[" in warnings["found_none"][0]
    assert warnings["asked_for_none"] == []


def test_an_inf_in_one_ranks_gradient_shard_skips_the_fp16_update_on_every_rank(fsdp_parts):
    """precision=16 under fsdp (ShardedGradScaler): rank 1's gradient shard holds an inf in the second
    update, so every rank skips it (its shards unchanged) and halves its loss scale alike; a scaler
    that looked at its own shards only would step rank 0's."""
    for rank in (0, 1):
        record = json.loads((fsdp_parts / f"inf_rank{rank}.json").read_text())
        assert record == {"scales": [2.0**16, 2.0**15], "changed": [True, False]}, rank


def test_a_sharded_checkpoint_holds_rank_zeros_batchnorm_statistics(fsdp_parts):
    """Each rank normalised its own batch (as without SyncBN), so their running statistics differ:
    the checkpoint holds rank 0's, as a checkpoint file does, and so do its export and mode=eval."""
    saved = full_model_state(fsdp_parts / "saved" / "checkpoints" / "step-00000001")
    ranks = [torch.load(fsdp_parts / f"buffers_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert not torch.equal(ranks[0]["features.1.running_mean"], ranks[1]["features.1.running_mean"])
    assert_same_state({key: saved[key] for key in ranks[0]}, ranks[0])


def test_each_rank_holds_about_half_of_ddps_parameters_gradients_and_optimizer_state(fsdp_run, ddp_run):
    """results.json's per-rank bytes, from the tensors each rank holds: under DDP every rank the whole
    model, its gradients and its momentum buffers; under fsdp on 2 ranks at most 55% of that each,
    and the shards together at least the whole. TensorBoard has the same figures at the last step."""
    fsdp, ddp = load_results(fsdp_run), load_results(ddp_run[0])
    model_bytes = 4 * sum(p.numel() for p in SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).parameters())
    for kind in ("parameter", "gradient", "optimizer_state"):  # SGD with momentum: one buffer per parameter
        assert ddp[f"{kind}_bytes_per_rank"] == [model_bytes, model_bytes], kind
        shards = fsdp[f"{kind}_bytes_per_rank"]
        assert len(shards) == 2 and all(0 < rank <= 0.55 * model_bytes for rank in shards) and sum(shards) >= model_bytes, kind
    accumulator = EventAccumulator(str(run_dirs(fsdp_run)[0]))
    accumulator.Reload()
    logged = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
              for tag in accumulator.Tags()["scalars"] if tag.startswith("memory/")}
    assert logged == {f"memory/{kind}_bytes/rank{rank}": [(16, bytes_)]
                      for kind in ("parameter", "gradient", "optimizer_state")
                      for rank, bytes_ in enumerate(fsdp[f"{kind}_bytes_per_rank"])}


def test_export_writes_one_plain_state_dict_for_the_bare_model_and_weights_path(fsdp_run, tmp_path):
    """`make export CKPT=<step dir>` (python -m ddp.checkpoints.export) writes <dir>/model.pt: the full weights,
    loading with weights_only=True into the unwrapped model, and through model.weights_path."""
    checkpoint = shutil.copytree(step_dir(fsdp_run, 16), tmp_path / "step-00000016")
    assert f"-m ddp.checkpoints.export {checkpoint}" in subprocess.run(["make", "-n", "export", f"CKPT={checkpoint}"], cwd=REPO,
                                                            capture_output=True, text=True).stdout
    result = subprocess.run([sys.executable, "-m", "ddp.checkpoints.export", str(checkpoint)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    check(result)
    exported = torch.load(checkpoint / "model.pt", weights_only=True)
    assert_same_state(exported, full_state(step_dir(fsdp_run, 16), tmp_path / "full")["model"])  # torch's own converter
    SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).load_state_dict(exported, strict=True)
    model = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16])
    load_weights(model, str(checkpoint / "model.pt"), num_classes=10)
    assert_same_state(model.state_dict(), exported)


def test_eval_of_a_sharded_checkpoint_in_one_process_reports_the_training_runs_metrics(fsdp_run, tmp_path, monkeypatch):
    """mode=eval reads fsdp's sharded checkpoint whole: one process without a process group reports
    the metrics that 2 fsdp ranks validated at the same step."""
    monkeypatch.chdir(tmp_path)
    evaluated = run_in_this_process(["mode=eval", "strategy=single", *TINY_DATA, f"resume={step_dir(fsdp_run, 16)}"], tmp_path / "eval")
    training = load_results(fsdp_run)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == evaluated
    assert (evaluated["world_size"], evaluated["step"], evaluated["val_samples"]) == (1, 16, 37)
    assert evaluated["val_accuracy"] == training["val_accuracy"]
    assert evaluated["val_loss"] == pytest.approx(training["val_loss"], rel=1e-6)  # float32 sums over other batch groupings


def test_a_sharded_checkpoint_whose_index_would_run_code_is_refused_and_never_run(fsdp_run, tmp_path, monkeypatch):
    """DCP's index (.metadata) is a pickle that torch's reader loads unrestricted. Resume, mode=eval
    and the export read it first with only the globals DCP writes there: an index that would call
    os.system is refused before anything runs it, and so is one that marks a weight as a pickled
    object (DCP loads those with weights_only=False)."""
    marker = tmp_path / "marker"
    evil = shutil.copytree(step_dir(fsdp_run, 16), tmp_path / "evil" / "step-00000016")
    index = FileSystemReader(step_dir(fsdp_run, 16)).read_metadata()  # our own checkpoint's, as DCP wrote it
    (evil / ".metadata").write_bytes(pickle.dumps(_CreatesFileWhenUnpickled(marker)))
    with pytest.raises(AttributeError):  # the payload is real: torch's own reader runs it, then finds an int
        FileSystemReader(evil).read_metadata()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"refused, it names (os|posix)\.system"):
        load_checkpoint(evil)
    with pytest.raises(CheckpointError, match="refused"):
        export_model(evil)
    monkeypatch.chdir(tmp_path)
    for overrides in (["mode=eval", "strategy=single", *TINY_DATA], ["strategy=fsdp", "strategy.nproc_per_node=2", *TINY]):
        line = config_error_in_this_process([*overrides, f"resume={evil}"], tmp_path / "run")
        assert "refused" in line and str(evil) in line, line
    assert not marker.exists()

    index.state_dict_metadata["model.features.0.weight"] = BytesStorageMetadata()
    (evil / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(CheckpointError, match=r"refused, it stores pickled objects.*\(model.features.0.weight\)"):
        load_checkpoint(evil)


# Accumulation and clipping: 2 ranks x 2 micro-batches of 4 under fsdp, against one process at the
# global batch of 16. GroupNorm, so micro-batching doesn't change the forward; a clip norm below the
# gradients' (train/grad_norm shows it), so every update is clipped. small_cnn's 4 FSDP units: its
# two convolutions, its linear layer, and the root (GroupNorm's parameters).
ACCUMULATED = [*TINY, "model.norm=group", "trainer.max_epochs=1", "trainer.gradient_clip_norm=0.05"]
FSDP_UNITS = 4


def test_accumulation_and_clipping_under_fsdp_train_as_one_process(tmp_path):
    """Gradients are reduce-scattered once per update, after its last micro-batch (each unit once;
    counted from outside the product code by tests/workers/instrumented_train.py), as SUMs that FSDP
    then divides (an AVG reduce-scatter on gloo has summed, pytorch#162338), and the run ends with one
    process's weights and logged gradient norms."""
    (tmp_path / "fsdp").mkdir()
    check(launch(["strategy=fsdp", *ACCUMULATED, "data.batch_size=4", "trainer.accumulate_grad_batches=2"], tmp_path / "fsdp",
                 nproc=2, env={"WATCH_DIR": str(tmp_path), "WATCH_TENSORS": "0"}, script=INSTRUMENTED))
    for rank in (0, 1):
        syncs = json.loads((tmp_path / f"syncs_rank{rank}.json").read_text())
        scatters = [steps_done for steps_done, name in syncs if name == "reduce_scatter_single"]
        assert scatters == [update for update in range(8) for _ in range(FSDP_UNITS)], scatters
        ops = json.loads((tmp_path / f"reduce_scatter_ops_rank{rank}.json").read_text())
        assert ops == ["RedOpType.SUM"] * len(scatters), ops
    runs = {"fsdp": run_dirs(tmp_path / "fsdp")[0], "single": tmp_path / "single"}
    run_in_this_process(["strategy=single", *ACCUMULATED, "data.batch_size=16"], runs["single"])
    fsdp = full_state(step_dir(tmp_path / "fsdp", 8), tmp_path)["model"]
    single = last_checkpoint(runs["single"])["model"]
    assert fsdp.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(fsdp[key], single[key], msg=lambda m, key=key: f"{key}: {m}")
    norms = {}
    for name, run_dir in runs.items():
        accumulator = EventAccumulator(str(run_dir))
        accumulator.Reload()
        norms[name] = [(event.step, event.value) for event in accumulator.Scalars("train/grad_norm")]
    assert [step for step, _ in norms["fsdp"]] == [2, 4, 6, 8] and all(norm > 0.05 for _, norm in norms["fsdp"])
    assert [norm for _, norm in norms["fsdp"]] == pytest.approx([norm for _, norm in norms["single"]], rel=1e-4)


# Both tasks: LEARN (tests/test_segmentation_runs.py: 2 ranks x batch 8 with SyncBN, Adam, random
# resize, crop and flip) under fsdp to its first checkpoint, against the DDP run's at the same step.
SEG_FSDP = ["strategy=fsdp", *[arg for arg in LEARN if arg != "strategy=ddp"], "trainer.max_steps=5"]


def test_segmentation_under_fsdp_trains_as_ddp_and_logs_its_image_grid(learned, tmp_path):
    """small_segnet's blocks are sharded; its first 5 updates end where DDP's did (float noise), the
    sharded model's validation counts all 37 images once, and the image grid, whose forwards every
    rank runs under fsdp, reaches TensorBoard."""
    check(launch(SEG_FSDP, tmp_path, nproc=2, timeout=300))
    fsdp = full_state(step_dir(tmp_path, 5), tmp_path)["model"]
    ddp = load_checkpoint(learned[0] / "checkpoints" / "step-00000005.pt")["model"]
    assert fsdp.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], msg=lambda m, key=key: f"{key}: {m}")
    results = load_results(tmp_path)
    assert (results["strategy"], results["steps"], results["val_samples"]) == ("fsdp", 5, 37)
    accumulator = EventAccumulator(str(run_dirs(tmp_path)[0]), size_guidance={"images": 0})
    accumulator.Reload()
    (grid,) = accumulator.Images("val/images")
    assert (grid.step, grid.height, grid.width) == (5, *GRID)


def tensors(state) -> list[torch.Tensor]:
    """Every tensor in a nested state (a model's and an optimizer's)."""
    if isinstance(state, torch.Tensor):
        return [state]
    return [tensor for value in (state.values() if isinstance(state, dict) else []) for tensor in tensors(value)]


# Mixed precision in a sweep: FSDP_RUN's training (without its sample records) in bf16 and in fp16,
# the two jobs of one torchrun multirun.
def run_precision_sweep(cwd: Path) -> dict:
    result = launch(["-m", *[arg for arg in FSDP_RUN if not arg.startswith("fault.")], "precision=bf16,16"], cwd, nproc=2)
    check(result)
    return as_json(result)


@pytest.fixture
def precision_sweep(tmp_path_factory):
    return shared_sweep("fsdp_precision_sweep", run_precision_sweep, tmp_path_factory)


def test_a_sweep_trains_fsdp_in_bf16_and_fp16_with_float32_master_weights(precision_sweep, fsdp_run, tmp_path):
    """Each job its own run dir and summary row. FSDP's MixedPrecisionPolicy computes in the low
    precision (the weights differ from the float32 run's) while the shards the optimizer steps and
    the checkpoint holds stay float32 and close to the float32 run's; fp16's GradScaler state is saved."""
    cwd, sweep_dir, _ = precision_sweep
    assert_one_run_per_job_dir(cwd, sweep_dir, {"train_rank0.log", "train_rank1.log"})
    rows = summary_rows(sweep_dir)
    assert [(row["status"], row["overrides"].split()[-1]) for row in rows] == [("ok", "precision=bf16"), ("ok", "precision=16")]
    fp32 = full_state(step_dir(fsdp_run, 16), tmp_path / "fp32")
    for job_dir, precision in zip(job_dirs(sweep_dir), ("bf16", "16"), strict=True):
        results = results_of(job_dir)
        assert (results["precision"], results["strategy"], results["steps"], results["val_samples"]) == (precision, "fsdp", 16, 37)
        checkpoint = job_dir / "checkpoints" / "step-00000016"
        low = full_state(checkpoint, tmp_path / precision)
        assert {tensor.dtype for tensor in tensors(low) if tensor.is_floating_point()} == {torch.float32}, precision
        weights = [key for key, tensor in fp32["model"].items() if tensor.is_floating_point()]
        assert any(not torch.equal(low["model"][key], fp32["model"][key]) for key in weights), precision
        for key in weights:
            torch.testing.assert_close(low["model"][key], fp32["model"][key], rtol=0, atol=0.01,
                                       msg=lambda m, key=key: f"{precision} {key}: {m}")
        scaler = load_checkpoint(checkpoint)["scaler"]
        assert (scaler is not None) == (precision == "16"), precision
