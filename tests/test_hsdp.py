"""strategy=hsdp under torchrun (CPU, gloo): FSDP2 over a 2-D mesh, sharded within groups and replicated
across them. On two localhost "nodes" of 2 processes its default shard groups are the nodes, and it ends
where DDP on 4 ranks ends, with SyncBN and without. Compiled, its blocks checkpointed, it trains as fsdp.
Its sharded checkpoints resume on other mesh shapes (FSDP on 4 and on 2 ranks, HSDP 1x2) and continue
the run, every sample trained once."""

import os
import subprocess

import pytest
import torch

from conftest import (TINY, TORCHRUN, TRAIN, check, free_port, last_checkpoint, launch, load_results, results_of, run_dirs,
                      shared_run)
from test_elastic import records
from test_sweeps import job_dirs, the_sweep_dir
from test_fsdp import FSDP_RUN, SAMPLES, fsdp_run, full_state, step_dir  # noqa: F401, F811 (fsdp_run: a fixture)

# DDP_RUN's training (conftest: a global batch of 16 with SyncBN, 16 steps) on 4 ranks of batch 4, saving every
# 5 steps, each rank recording the samples it trains.
HSDP_RUN = ["strategy=hsdp", "syncbn=true", *TINY, "data.batch_size=4", "checkpoint.keep_best=0", "checkpoint.every_n_steps=5",
            "fault.record_samples_dir=samples", "strategy.timeout_s=60"]


def run_on_two_nodes(cwd) -> dict:
    """HSDP_RUN by two torchrun agents of 2 processes each (node ranks 0 and 1) meeting on localhost."""
    port = free_port()
    agents = []
    for node in (0, 1):
        command = [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", "--master_addr=127.0.0.1",
                   f"--master_port={port}", str(TRAIN), *HSDP_RUN]
        agents.append(subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=launch_env()))
    for agent in agents:
        output, _ = agent.communicate(timeout=240)
        assert agent.returncode == 0, output[-6000:]
    return {}


def launch_env() -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return clean | {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture
def hsdp_run(tmp_path_factory):
    """HSDP_RUN on two localhost nodes, once for all test processes: its cwd."""
    return shared_run("hsdp_run", run_on_two_nodes, tmp_path_factory)[0]


def assert_close_states(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and any(key.endswith("running_var") for key in expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=lambda m, key=key: f"{key}: {m}")


def run_ddp_on_4(cwd) -> dict:
    """DDP on 4 ranks of batch 4, with SyncBN and without, as a torchrun sweep."""
    check(launch(["-m", "strategy=ddp", "syncbn=false,true", *TINY, "data.batch_size=4", "checkpoint.keep_best=0"], cwd, nproc=4))
    return {}


@pytest.fixture
def ddp_on_4(tmp_path_factory) -> dict:
    """{syncbn: the job dir} of run_ddp_on_4, once for all test processes."""
    sweep = the_sweep_dir(shared_run("ddp_on_4", run_ddp_on_4, tmp_path_factory)[0])
    return dict(zip((False, True), job_dirs(sweep)))


def test_hsdp_on_two_nodes_shards_within_each_node_and_trains_as_ddp_on_4_ranks(hsdp_run, ddp_on_4, single_run, tmp_path):
    """strategy.shard_size unset: a shard group is a node's 2 processes (ranks 0-1 and 2-3), each a replica;
    with SyncBN the final weights and metrics are DDP's on 4 ranks (and one process's at the global batch of 16),
    and each rank holds half of DDP's bytes: its shard of its group's replica."""
    (run_dir,) = run_dirs(hsdp_run)
    log = (run_dir / "train_rank0.log").read_text()
    assert "hsdp: 3 block(s) sharded, then the root, in 2 replicas, each sharded over 2 ranks [[0, 1], [2, 3]]" in log, log
    hsdp = full_state(step_dir(hsdp_run, 16), tmp_path)["model"]
    assert_close_states(hsdp, last_checkpoint(ddp_on_4[True])["model"])
    assert_close_states(hsdp, last_checkpoint(single_run)["model"])
    results, ddp = load_results(hsdp_run), results_of(ddp_on_4[True])
    assert (results["strategy"], results["world_size"], results["steps"], results["global_batch_size"]) == ("hsdp", 4, 16, 16)
    assert results["val_samples"] == ddp["val_samples"] == 37
    assert results["val_accuracy"] == ddp["val_accuracy"]
    assert results["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    assert results["replicas_identical"] is True
    for key in ("parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_state_bytes_per_rank"):
        assert results[key] == [ddp[key][0] // 2] * 4, key


def test_hsdp_without_syncbn_trains_as_ddp_on_4_ranks(ddp_on_4, tmp_path):
    """Each rank's BatchNorm normalises with its own batch's statistics, as under DDP: 2x2 HSDP (strategy.shard_size=2
    on one node of 4 processes) ends within float noise of DDP on 4 ranks."""
    check(launch(["strategy=hsdp", "strategy.shard_size=2", *TINY, "data.batch_size=4", "checkpoint.keep_best=0"], tmp_path, nproc=4))
    assert_close_states(full_state(step_dir(tmp_path, 16), tmp_path / "full")["model"], last_checkpoint(ddp_on_4[False])["model"])


@pytest.mark.parametrize("strategy, world_size", [("fsdp", 4), ("fsdp", 2), ("hsdp", 2)])
def test_a_checkpoint_of_hsdp_2x2_resumes_on_other_mesh_shapes_and_continues_the_run(hsdp_run, strategy, world_size, tmp_path):
    """Saved by HSDP 2x2 at step 10 (epoch 1, 2 batches in), resumed as FSDP on 4 ranks, FSDP on 2 and HSDP 1x2 (a
    node of 2) at the same global batch: DCP reshards the model and optimizer, the rest of epoch 1 holds exactly the
    samples the checkpoint hadn't trained, and the weights at step 16 are the uninterrupted run's within float noise."""
    args = [f"strategy={strategy}", "syncbn=true", *TINY, f"data.batch_size={16 // world_size}", "checkpoint.keep_best=0",
            f"resume={step_dir(hsdp_run, 10)}", "fault.record_samples_dir=resumed"]
    check(launch(args, tmp_path, nproc=world_size))
    kept = [i for r in records(hsdp_run / "samples", attempt=0) if r["epoch"] == 1 and r["step"] <= 10 for i in r["ids"]]
    rest = [i for r in records(tmp_path / "resumed", attempt=0) if r["epoch"] == 1 for i in r["ids"]]
    assert len(kept) == 2 * 16 and sorted(kept + rest) == list(range(SAMPLES))
    (run_dir,) = run_dirs(tmp_path)
    assert_close_states(full_state(run_dir / "checkpoints" / "step-00000016", tmp_path / "a")["model"],
                        full_state(step_dir(hsdp_run, 16), tmp_path / "b")["model"])


def test_hsdp_compiles_each_block_and_checkpoints_it_and_trains_as_fsdp(fsdp_run, tmp_path):
    """compile=true under hsdp (one node of 2: a 1x2 mesh) compiles each block, the unit FSDP shards, its forward
    checkpointed too (activation_checkpointing=full): the weights end within float noise of fsdp's uncompiled run."""
    args = [arg.replace("strategy=fsdp", "strategy=hsdp") for arg in FSDP_RUN]
    check(launch([*args, "compile=true", "activation_checkpointing=full", "fault.record_samples_dir=null"], tmp_path, nproc=2))
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "train_rank0.log").read_text()
    assert "compile=true: 3 blocks compiled, each where FSDP shards it" in log, log
    assert "activation_checkpointing=full: 3 of 3 blocks (Conv2d/Linear) recompute" in log, log
    assert_close_states(full_state(step_dir(tmp_path, 16), tmp_path / "a")["model"],
                        full_state(step_dir(fsdp_run, 16), tmp_path / "b")["model"])
