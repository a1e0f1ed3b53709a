"""Real multi-process runs of train.py under torchrun (CPU, gloo): the properties DDP users rely on.

Covered by other modules' runs, which already launch them:
- ranks agreeing on the run dir through torchrun's shared store (its default): the 2-rank run of
  tests/test_segmentation_runs.py (`learned`) runs with it, and tests/test_clusters.py's static
  rendezvous agrees through it across two agents (the other tests here disable it);
- evaluation exact with 3 ranks (uneven shards): mode=eval of a 2-rank DDP run's checkpoint on 3 ranks
  in tests/test_models_and_data.py (classification, 37 samples), and of a segmentation run's in
  tests/test_segmentation_runs.py; 2 ranks: test_reported_metrics_are_those_of_the_saved_model below."""

import json
import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import train
from conftest import (REPO, TINY, assert_no_process_group_left_at_exit, final_weights, load_last, load_results,
                      results_of, run_dirs, shared_run_in_this_process)
from data import build_datasets
from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_val_loader
from models import build_model
from models.small_cnn import SmallCNN
from ddp.training.evaluation import evaluate
from tasks.classification import ClassificationTask


def test_two_ranks_match_one_process_with_the_global_batch(ddp_run, single_run):
    ddp_state, single_state = load_last(ddp_run[0])["model"], final_weights(single_run)
    assert ddp_state.keys() == single_state.keys()
    assert any(key.endswith("running_var") for key in ddp_state)
    for key in ddp_state:
        torch.testing.assert_close(ddp_state[key], single_state[key], msg=lambda m, key=key: f"{key}: {m}")
    ddp_results, single_results = load_results(ddp_run[0]), results_of(single_run)
    assert ddp_results["steps"] == single_results["steps"] == 16
    assert (ddp_results["global_batch_size"], single_results["global_batch_size"]) == (16, 16)


def test_accumulation_is_not_a_bigger_batch_with_batchnorm(ddp_run, single_run, tmp_path_factory):
    """docs/fault-tolerance.md: to continue 2 ranks x 8 with SyncBN in one process, hold the global batch
    through data.batch_size=16, not accumulation: 1 x 8 x accumulation 2 normalises over 8 samples per
    forward, and ends far from the 2-rank run (1 x 16 ends within float noise of it, the test above)."""
    accumulated = shared_run_in_this_process(
        "accumulated_run", ["strategy=single", *TINY, "data.batch_size=8", "trainer.accumulate_grad_batches=2"], tmp_path_factory)
    ddp_state, accumulated_state = load_last(ddp_run[0])["model"], final_weights(accumulated)
    assert results_of(accumulated)["global_batch_size"] == 16
    def farthest(state: dict) -> float:  # over the float tensors (num_batches_tracked counts forwards)
        return max((ddp_state[k] - w).abs().max().item() for k, w in state.items() if w.is_floating_point())

    noise, apart = farthest(final_weights(single_run)), farthest(accumulated_state)
    assert apart > 1000 * noise and apart > 1e-3, (apart, noise)


def test_ranks_end_bit_identical_and_the_replica_check_sees_one_ulp(plain_ddp_run):
    """Each rank's final weights, saved from outside train.py's code, are equal bit for bit (BatchNorm
    buffers too: rank 0's are broadcast before the final evaluation), and equal to the checkpoint;
    the product's replica check agrees, and says False when rank 1 differs by one ulp."""
    cwd, _ = plain_ddp_run
    watch = cwd / "watch"
    rank0, rank1 = (torch.load(watch / f"state_rank{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0.keys() == rank1.keys() and any(key.endswith("running_mean") for key in rank0)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
        assert torch.equal(rank0[key], load_last(cwd)["model"][key]), key
    assert load_results(cwd)["replicas_identical"] is True
    assert [(watch / f"nudged_rank{rank}.txt").read_text() for rank in (0, 1)] == ["False", "False"]


def test_reported_metrics_are_those_of_the_saved_model(plain_ddp_run):
    """Without SyncBN every rank updates BatchNorm statistics from its own batches. The metrics a
    2-rank run reports must be those of the model it saved: its last.pt, evaluated in one process."""
    cwd, _ = plain_ddp_run
    checkpoint, results = load_last(cwd), load_results(cwd)
    cfg = OmegaConf.create(checkpoint["config"])
    splits = build_datasets(cfg.data)
    model = build_model(cfg.model, splits.num_classes, splits.in_channels)
    model.load_state_dict(checkpoint["model"], strict=True)
    metrics = evaluate(model, build_val_loader(splits.val, cfg.data, DistEnv(), pin_memory=False), torch.device("cpu"), -1, ClassificationTask())
    assert metrics["val_samples"] == results["val_samples"] == 37
    assert metrics["val_accuracy"] == results["val_accuracy"]
    assert metrics["val_loss"] == pytest.approx(results["val_loss"], rel=1e-6)  # float32 sums over other batch groupings


def test_no_collective_or_host_read_on_steps_that_do_not_log(plain_ddp_run):
    """The CPU must be able to queue step k+1 while the device runs step k: between two optimizer
    steps that neither log, end an epoch nor save, train.py does no collective and reads no tensor
    back to the host, with fp16, clipping and EMA on (DDP's own gradient all_reduce runs in C++,
    outside what is counted). The one read there is torch's own: GradScaler.step reads whether the
    gradients were finite, once per update. On log steps the ranks agree on a non-finite loss, on
    SIGTERM and on each rank's data wait and compute: one all_gather there, no other collective."""
    cwd, _ = plain_ddp_run
    assert load_last(cwd)["scaler"]["scale"] == 2.0**16  # no update skipped: optimizer steps number the updates
    quiet_steps = [step for step in range(1, 16) if step % 4 and step != 8]
    for rank in (0, 1):
        events = json.loads((cwd / "watch" / f"syncs_rank{rank}.json").read_text())
        by_step: dict[int, list[str]] = {}
        for step, name in events:
            by_step.setdefault(step, []).append(name)
        # no collective, no .tolist(), and one .item(): GradScaler's, as the host reads below show
        assert {step: by_step.get(step) for step in quiet_steps} == {step: ["item"] for step in quiet_steps}, rank
        for log_step in (4, 12):
            collectives = [name for name in by_step[log_step] if name.startswith(("all_", "broadcast", "reduce", "gather"))]
            assert collectives == ["all_gather"] and "item" in by_step[log_step], (rank, by_step.get(log_step))
        host_reads = json.loads((cwd / "watch" / f"host_reads_rank{rank}.json").read_text())
        quiet_reads = [(step, kind, where.split(":")[0]) for step, kind, where in host_reads if step in quiet_steps]
        assert quiet_reads == [(step, "_local_scalar_dense", "torch/amp/grad_scaler.py") for step in quiet_steps], rank


def test_ddp_ranks_exit_with_no_process_group_left(ddp_run):
    """DDP's reducer holds the default group, CPU SyncBN's modules a group of their own."""
    assert_no_process_group_left_at_exit(ddp_run[0])


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
    assert results["samples_per_s_per_rank"] == pytest.approx(results["samples_per_s"] / 2)
    assert len(results["peak_memory_mb_per_rank"]) == 2 and results["peak_memory_mb_per_rank"][0] == results["peak_memory_mb"]
    assert all(mb > 0 for mb in results["peak_memory_mb_per_rank"])
    assert len(results["data_wait_fraction_per_rank"]) == 2 and all(0 <= f < 1 for f in results["data_wait_fraction_per_rank"])


def test_ddp_checkpoint_loads_strictly_into_a_single_model(ddp_run):
    checkpoint = load_last(ddp_run[0])
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (2, 0, 16)
    assert checkpoint["optimizer"]["state"], "optimizer state is saved"
    assert all(t.device.type == "cpu" for t in checkpoint["model"].values())
    SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]).load_state_dict(checkpoint["model"], strict=True)


def test_dataparallel_run_resumes_a_ddp_checkpoint_and_reports_its_metrics(ddp_run, tmp_path, monkeypatch, caplog):
    """strategy=dp end to end: the 2-rank DDP checkpoint loads into the DataParallel run (world size 1:
    weights only, with a warning), nothing is left to train, and DP's eval path scores the same model
    with the same metrics; without GPUs the run says it uses one CPU replica. (train.run in this
    process, whose log records are the run's console lines: a launch would cost seconds of start-up.)"""
    ddp_dir = run_dirs(ddp_run[0])[0]
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=dp", "syncbn=true", *TINY, f"resume={ddp_dir / 'checkpoints' / 'last.pt'}"])
    run_dir = tmp_path / "outputs" / "run"
    run_dir.mkdir(parents=True)
    with caplog.at_level(logging.INFO):
        train.run(cfg, run_dir, relaunch="")
    assert ("checkpoint has world_size=2, this run 1: the data position is kept exactly (sample 0 of epoch 2 on), but the "
            "per-rank RNG states don't carry over: bit-identical only at an equal world size") in caplog.text
    assert "no CUDA GPUs visible, so DataParallel runs one replica on CPU" in caplog.text
    assert "syncbn=true has no effect with strategy=dp: DataParallel's replicas each normalise their own chunk" in caplog.text
    dp, ddp = json.loads((run_dir / "results.json").read_text()), load_results(ddp_run[0])
    assert (dp["strategy"], dp["world_size"], dp["steps"]) == ("dp", 1, 16)
    assert dp["val_samples"] == ddp["val_samples"] == 37
    assert dp["val_accuracy"] == ddp["val_accuracy"]
    assert dp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-6)
