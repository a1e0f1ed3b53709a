"""Elastic scale-down with real torchrun agents on localhost: two agents as two "nodes" under c10d
rendezvous with `--nnodes=1:2`; one node is lost mid-epoch, and the other finishes the run alone.
What must hold: one run dir, every sample of the interrupted epoch trained exactly once (recorded
by each rank through fault.record_samples_dir), and the global batch kept by trainer.global_batch_size."""

import json
import logging
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, TORCHRUN, TRAIN, free_port, run_dirs, run_in_this_process, sigterm_when
from train import TrainingLength

# 96 samples, batch 4: 2 ranks take 12 steps per epoch; one process accumulates 2 batches per step.
ARGS = ["strategy=ddp", *TINY, "data.num_samples=96", "data.num_val_samples=16", "data.batch_size=4",
        "trainer.global_batch_size=8", "trainer.max_epochs=2", "checkpoint.every_n_steps=2", "fault.record_samples_dir=samples"]
SAMPLES, STEPS_PER_EPOCH = 96, 12
# Short rendezvous timings, so the survivor re-forms the group within seconds: a node is dead after
# keep_alive_interval x keep_alive_max_attempt s without a heartbeat, and a group smaller than
# --nnodes' maximum forms last_call_timeout s after the minimum has joined. That must leave both
# agents, started together, time to join the first round.
RDZV_CONF = "join_timeout=60,last_call_timeout=5,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
TIMEOUT_S = 150


@pytest.mark.parametrize("world_size, accumulate", [(1, 4), (2, 2), (4, 1)])
def test_global_batch_size_keeps_the_global_batch_and_updates_per_epoch(world_size, accumulate):
    """trainer.global_batch_size=16 with batch 4: the accumulation follows the world size, so the
    updates (and the LR schedule, in updates) stay the same when an elastic run scales."""
    trainer = SimpleNamespace(limit_train_batches=-1, accumulate_grad_batches=1, global_batch_size=16, max_epochs=3, max_steps=-1)
    length = TrainingLength.of(trainer, train_size=96, batch_size=4, world_size=world_size)
    assert (length.accumulate, length.global_batch, length.updates_per_epoch, length.total_updates) == (accumulate, 16, 6, 18)



def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc: Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def records(directory: Path, attempt: int) -> list[dict]:
    """Every batch that the ranks of one torchrun attempt started to train, in file order."""
    return [json.loads(line) for path in sorted(directory.glob(f"rank*_attempt{attempt}.jsonl"))
            for line in path.read_text().splitlines()]


def test_losing_a_node_mid_epoch_the_survivor_trains_every_sample_once(tmp_path):
    port, run_id = free_port(), uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def agent(name: str, is_host: int, extra: list[str]) -> subprocess.Popen:
        command = [str(TORCHRUN), "--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id={run_id}", f"--rdzv-conf={RDZV_CONF},is_host={is_host}",
                   "--max-restarts=2", str(TRAIN), *ARGS, *extra]
        with open(tmp_path / f"{name}.out", "w") as out:
            # the same cwd: the agents' workers agree on the run dir under outputs/ (ddp/jobs/run_dir.py)
            return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(tmp_path.glob("*.out")))

    started = time.monotonic()
    survivor = agent("survivor", 1, [])  # hosts the rendezvous store, so it must be the one that stays
    # The lost node's worker stops after its step 3 (whatever its rank), so the loss lands at a known
    # point: after the step-2 checkpoint, before step 4's, which needs both ranks.
    lost = agent("lost", 0, ["fault.stall_rank=${oc.env:RANK}", "fault.at_step=3"])
    try:
        deadline = time.monotonic() + 90
        while not any("stalling at step 3" in log.read_text() for log in (tmp_path / "outputs").rglob("train_rank*.log")):
            assert survivor.poll() is None and lost.poll() is None, f"an agent ended early\n{logs()}"
            assert time.monotonic() < deadline, f"training never reached step 3\n{logs()}"
            time.sleep(0.2)
        # A lost node takes its agent and its worker; torchrun starts each worker in a session of its own.
        workers = children(lost.pid)
        os.killpg(lost.pid, signal.SIGKILL)
        for worker in workers:
            os.killpg(worker, signal.SIGKILL)
        lost.wait()
        returncode = survivor.wait(timeout=TIMEOUT_S - (time.monotonic() - started))
    finally:
        for process in (survivor, lost):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    wall_s = time.monotonic() - started
    assert returncode == 0, logs()

    (run_dir,) = run_dirs(tmp_path)  # one run dir for both nodes and the restart
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["world_size"], results["accumulate_grad_batches"], results["global_batch_size"]) == (1, 2, 8)
    assert (results["epochs"], results["steps"]) == (2, 2 * STEPS_PER_EPOCH)  # updates per epoch kept
    rank0 = (run_dir / "train_rank0.log").read_text()
    assert "checkpoint has world_size=2, this run 1: the data position is kept exactly" in rank0, rank0
    (resumed,) = re.findall(r"resumed from \S+ at epoch (\d+), batch \d+, step (\d+)", rank0)
    epoch, step = map(int, resumed)
    assert (epoch, step) == (0, 2), rank0  # the newest checkpoint: step 4 never completed

    samples = tmp_path / "samples"
    before, after = records(samples, attempt=0), records(samples, attempt=1)
    assert sorted(p.name for p in samples.iterdir()) == ["rank0_attempt0.jsonl", "rank0_attempt1.jsonl", "rank1_attempt0.jsonl"]
    # What the checkpoint holds of the first attempt (2 ranks), and everything after the resume (1 process).
    kept = [i for r in before if r["epoch"] == epoch and r["step"] <= step for i in r["ids"]]
    assert len(kept) == step * 8 and any(r["step"] > step for r in before)  # the lost steps were trained, then dropped
    rest = [i for r in after if r["epoch"] == epoch for i in r["ids"]]
    assert sorted(kept + rest) == list(range(SAMPLES)), (kept, rest)
    last = [i for r in after if r["epoch"] == epoch + 1 for i in r["ids"]]
    assert sorted(last) == list(range(SAMPLES))
    assert wall_s < TIMEOUT_S
    print(f"elastic scale-down: {wall_s:.1f} s")


def test_stopped_at_an_epochs_partial_last_batch_two_ranks_resume_in_one_process(tmp_path, monkeypatch, caplog):
    """100 samples on 2 ranks x batch 8: 7 steps an epoch, the last of 2 samples per rank. Stopped at
    epoch 0's end (ranks agree on a SIGTERM only at log steps, here none, and at an epoch's end), the
    run dir resumes in one process (train.run in this one): at that end, with 100 samples of the
    epoch trained, not 7 x 16."""
    args = [*TINY, "data.num_samples=100", "data.batch_size=8", "trainer.log_every_n_steps=100", "checkpoint.every_n_steps=0",
            "hydra.run.dir=outputs/run"]
    run_dir, samples = tmp_path / "outputs" / "run", tmp_path / "samples"
    command = [str(TORCHRUN), "--nproc_per_node=2", str(TRAIN), "strategy=ddp", *args, "fault.record_samples_dir=samples",
               "fault.slow_rank=0", "fault.slow_ms=400"]  # epoch 0 lasts 7 x 0.4 s: the signal lands inside it
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with open(tmp_path / "ddp.out", "w") as out:
        process = subprocess.Popen(command, cwd=tmp_path, env=env | {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # rank 0 writes the file as it starts its first batch
    returncode = sigterm_when(process, (samples / "rank0_attempt0.jsonl").exists, (tmp_path / "ddp.out").read_text)
    assert returncode != 0, (tmp_path / "ddp.out").read_text()[-6000:]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (0, 7, 7)
    assert checkpoint["samples_in_epoch"] == 100

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        run_in_this_process(["strategy=single", *args, "trainer.max_epochs=2", "resume=outputs/run",
                             "fault.record_samples_dir=resumed"], run_dir)
    assert "at epoch 0, batch 12, step 7 (100 samples of the epoch trained)" in caplog.text, caplog.text[-4000:]
    before, after = records(samples, attempt=0), records(tmp_path / "resumed", attempt=0)
    assert sorted(i for r in before for i in r["ids"]) == list(range(100))  # all of epoch 0, none of epoch 1
    assert {r["epoch"] for r in before} == {0} and {r["epoch"] for r in after} == {1}
    assert sorted(i for r in after for i in r["ids"]) == list(range(100))
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["epochs"], results["steps"]) == (2, 7 + 13)
