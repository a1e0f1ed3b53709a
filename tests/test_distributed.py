"""Real multi-process runs of train.py under torchrun (CPU, gloo): the properties DDP users rely on."""

import json
import os
import socket
import subprocess

import pytest
import torch
from torch import nn

from conftest import REPO, TINY, TORCHRUN, check, launch, load_last, load_results, run_dirs
from ddp.wrap import unwrap_model
from models.small_cnn import SmallCNN


def test_two_ranks_match_one_process_with_the_global_batch(ddp_run, single_run):
    ddp_state, single_state = load_last(ddp_run[0])["model"], load_last(single_run[0])["model"]
    assert ddp_state.keys() == single_state.keys()
    assert any(key.endswith("running_var") for key in ddp_state)
    for key in ddp_state:
        torch.testing.assert_close(ddp_state[key], single_state[key], msg=lambda m, key=key: f"{key}: {m}")
    ddp_results, single_results = load_results(ddp_run[0]), load_results(single_run[0])
    assert ddp_results["steps"] == single_results["steps"] == 16
    assert (ddp_results["global_batch_size"], single_results["global_batch_size"]) == (16, 16)


def test_ranks_end_bit_identical(ddp_run):
    assert load_results(ddp_run[0])["replicas_identical"] is True


def test_one_run_dir_one_hydra_dir_rank_zero_events_and_a_log_per_rank(ddp_run):
    cwd, _ = ddp_run
    (run_dir,) = run_dirs(cwd)
    assert [p.parent for p in (cwd / "outputs").rglob(".hydra")] == [run_dir]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    events = list(cwd.rglob("events.out.tfevents*"))
    assert [e.parent for e in events] == [run_dir], events
    assert sorted(p.name for p in (cwd / "outputs").rglob("*.pt")) == ["last.pt", "step-00000016.pt"]
    for rank in (0, 1):
        text = (run_dir / f"train_rank{rank}.log").read_text()
        assert f"[rank {rank}]" in text and f"[rank {1 - rank}]" not in text


def test_console_shows_rank_zero_only(ddp_run):
    _, result = ddp_run
    assert "[rank 0]" in result.stdout and "[rank 1]" not in result.stdout


def test_results_report_the_run(ddp_run):
    results = load_results(ddp_run[0])
    assert results["strategy"] == "ddp" and results["world_size"] == 2
    assert (results["batch_size"], results["global_batch_size"]) == (8, 16)
    assert results["val_samples"] == 37  # odd: no padded duplicates reach the metrics
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s", "wall_s", "peak_memory_mb"):
        assert results[key] > 0, key


def test_ddp_checkpoint_loads_strictly_into_single_and_dataparallel_models(ddp_run):
    checkpoint = load_last(ddp_run[0])
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (2, 0, 16)
    assert checkpoint["optimizer"]["state"], "optimizer state is saved"
    single = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16])
    single.load_state_dict(checkpoint["model"], strict=True)
    dataparallel = nn.DataParallel(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]))
    unwrap_model(dataparallel).load_state_dict(checkpoint["model"], strict=True)
    images = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(single.eval()(images), dataparallel.eval()(images), rtol=0, atol=0)


def test_ranks_agree_on_the_run_dir_with_torchruns_shared_store(tmp_path):
    """torchrun's default (a store shared with the workers) takes the other agreement path than the
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 that the other tests use."""
    result = launch(["strategy=ddp", *TINY, "trainer.max_epochs=1"], tmp_path, nproc=2,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    check(result)
    (run_dir,) = run_dirs(tmp_path)
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]


def test_ranks_agree_on_the_run_dir_with_static_rendezvous(tmp_path):
    """--master-port (as many tutorials launch) gives no run id; the agent's store still agrees."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(TORCHRUN), "--nproc_per_node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               str(REPO / "train.py"), "strategy=ddp", *TINY, "trainer.max_epochs=1"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    check(result)
    assert len(run_dirs(tmp_path)) == 1


def test_eval_counts_every_sample_once_for_any_world_size(tmp_path):
    metrics = {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"metrics{nproc}.json"
        result = subprocess.run(
            [str(TORCHRUN), f"--nproc_per_node={nproc}", str(REPO / "tests" / "workers" / "evaluate_shards.py"), str(out), "101"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env=os.environ | {"PYTHONPATH": str(REPO)},
        )
        check(result)
        metrics[nproc] = json.loads(out.read_text())
    assert [m["val_samples"] for m in metrics.values()] == [101, 101, 101]
    assert metrics[1]["val_accuracy"] == metrics[2]["val_accuracy"] == metrics[3]["val_accuracy"]
    for nproc in (2, 3):
        assert metrics[nproc]["val_loss"] == pytest.approx(metrics[1]["val_loss"], rel=1e-6)  # float32 sums over different batch groupings
