"""checkpoint.async_save=true under DDP and FSDP on 2 ranks (gloo): a save copies the state and training goes on
while a thread writes it. Every checkpoint is bit for bit what the same run saving in the loop saves; a rank killed while a
background write is in flight resumes from the checkpoint before it, bit-identical; a SIGTERM during a background
write exits only once it is complete, and the resume continues, bit-identical. (Each write is made slow with
fault.slow_save_step / fault.slow_save_s, a sleep in the writer thread, so that the fault meets it in flight.)"""

import re

import pytest
import torch

from conftest import (TORCHRUN, TRAIN, assert_no_process_group_left_at_exit, check, exit_watch, launch, run_dirs, shared_run,
                      sigterm_when)
from ddp.checkpoints.checkpoint import load_checkpoint
from test_fault_tolerance import assert_same_state, output, torchrun
from test_fsdp import FSDP_RUN, full_state
from test_interrupts import start
from test_sweeps import job_dirs, the_sweep_dir

# FSDP_RUN's training (2 ranks x batch 8 with SyncBN, 16 steps, tests/test_fsdp.py), saving every 5 steps, the last 4 kept
RUN = [*(arg for arg in FSDP_RUN if arg != "strategy=fsdp"), "checkpoint.every_n_steps=5", "checkpoint.keep_last=4"]
ASYNC = [*RUN, "checkpoint.async_save=true"]
STEPS = (5, 10, 15, 16)


def final_state(run_dir, strategy: str, tmp, step: int = 16) -> dict:
    """A checkpoint's model and optimizer states, and every rank's RNG state but Python's (`seed` doesn't seed it)."""
    if strategy == "ddp":
        checkpoint = torch.load(run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)
        tensors = {key: checkpoint[key] for key in ("model", "optimizer")}
    else:
        path = run_dir / "checkpoints" / f"step-{step:08d}"
        checkpoint, tensors = load_checkpoint(path), full_state(path, tmp)
    ranks = [{key: value for key, value in rank.items() if key != "python_rng"} for rank in checkpoint["ranks"]]
    return tensors | {"ranks": ranks, "global_step": checkpoint["global_step"]}


def run_sweep(cwd) -> dict:
    """Step 5's background write waits 1 s first: the training goes on changing the weights meanwhile."""
    check(launch(["-m", *RUN, "strategy=ddp,fsdp", "checkpoint.async_save=false,true", "fault.slow_save_step=5",
                  "fault.slow_save_s=1"], cwd, nproc=2, env=exit_watch(cwd)))
    return {}


@pytest.fixture
def sweep(tmp_path_factory) -> dict:
    """RUN as a torchrun sweep over strategy=ddp,fsdp x checkpoint.async_save=false,true, once for all test processes:
    {(strategy, async_save): its job dir}."""
    jobs = {}
    for job_dir in job_dirs(the_sweep_dir(shared_run("async_save_sweep", run_sweep, tmp_path_factory)[0])):
        swept = dict(override.split("=") for override in job_dir.name.split("_", 1)[1].split(","))
        jobs[swept["strategy"], swept["checkpoint.async_save"].lower()] = job_dir
    return jobs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_background_saves_hold_what_saves_in_the_loop_hold(sweep, strategy, tmp_path):
    """Every checkpoint, step 5's too (written while the next 5 steps trained), is bit for bit the synchronous run's."""
    log = (sweep[strategy, "true"] / "train_rank0.log").read_text()
    for step in STEPS:
        assert f"checkpoint of step {step}: copied, being written in the background" in log, log
        assert_same_state(final_state(sweep[strategy, "true"], strategy, tmp_path / f"a{step}", step),
                          final_state(sweep[strategy, "false"], strategy, tmp_path / f"b{step}", step), f"step {step}")
    assert "checkpoint of step 5: waited" in log  # at step 10's save


def test_the_saves_own_process_group_is_gone_before_the_ranks_exit(sweep):
    """The sharded save's gloo group, like the training's, is destroyed and let go of before each rank's exit begins."""
    assert_no_process_group_left_at_exit(sweep["fsdp", "true"].parent.parent.parent.parent)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_killed_during_a_background_write_resumes_from_the_checkpoint_before(sweep, strategy, tmp_path):
    """The write of step 10 is still in flight (it waits 600 s first) when rank 1 dies at step 12: the restart finds
    step 5 the newest checkpoint, resumes from it, and ends bit-identical to the uninterrupted run."""
    result = torchrun([*ASYNC, f"strategy={strategy}", "fault.slow_save_step=10", "fault.slow_save_s=600",
                       "fault.kill_rank=1", "fault.at_step=12"], tmp_path, max_restarts=1)
    assert result.returncode == 0, output(result)
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "train_rank0.log").read_text()
    assert "fault.slow_save_step=10: its background write waits 600 s first" in log
    assert re.search(r"resumed from \S+ at epoch 0, batch 5, step 5\b", log), log
    assert_same_state(final_state(run_dir, strategy, tmp_path / "a"), final_state(sweep[strategy, "true"], strategy, tmp_path / "b"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_during_a_background_write_exits_once_it_is_complete_and_the_resume_continues(sweep, strategy, tmp_path):
    """Step 10's write waits 6 s; SIGTERM to torchrun as it starts. The ranks stop at the next step, wait for step 10's
    write, save the stop's step and exit; both checkpoints are complete and verified, and a resume from the run dir
    ends bit-identical to the uninterrupted run. Rank 1's every step takes 1 s longer (fault.slow_rank, a sleep: it
    changes no number), so that the signal, on a loaded machine too, comes before step 15's save, the last before
    the run's end at step 16 (it took milliseconds to get there from step 10, and a test failed once)."""
    run_dir = tmp_path / "outputs" / "run"
    process = start([str(TORCHRUN), "--nproc_per_node=2", "--shutdown-timeout=60", str(TRAIN), *ASYNC, f"strategy={strategy}",
                     "fault.slow_save_step=10", "fault.slow_save_s=6", "fault.slow_rank=1", "fault.slow_ms=1000",
                     "hydra.run.dir=outputs/run"], tmp_path)
    log_file = run_dir / "train_rank0.log"
    slow_write = "fault.slow_save_step=10: its background write waits 6 s first"
    returncode = sigterm_when(process, lambda: log_file.exists() and slow_write in log_file.read_text(),
                              (tmp_path / "stderr.txt").read_text)
    log = log_file.read_text()
    assert returncode != 0, log
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", log)
    assert stopped, log[-4000:]
    stop_step = int(stopped.group(1))
    assert 10 < stop_step < 16 and "checkpoint of step 10: waited" in log, log[-4000:]
    suffix = ".pt" if strategy == "ddp" else ""
    for step in (10, stop_step):
        assert load_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}{suffix}")["global_step"] == step  # complete, verified
    check(launch([*ASYNC, f"strategy={strategy}", "resume=outputs/run", "hydra.run.dir=outputs/run"], tmp_path, nproc=2))
    resumed = rf"resumed from \S+ at epoch 1, batch {stop_step - 8}, step {stop_step}\b"
    assert re.search(resumed, (run_dir / "train_rank0.log").read_text())
    assert_same_state(final_state(run_dir, strategy, tmp_path / "a"), final_state(sweep[strategy, "true"], strategy, tmp_path / "b"))
