"""Ctrl-C as a terminal sends it: SIGINT to the whole process group of the command, under every
launcher. The first one saves at the next step and prints how to continue; the second exits at once.
SIGTERM to torchrun (preemption): in one chain with Ctrl-C under torchrun and under the self-launched
DDP (strategy.nproc_per_node), below. (SIGTERM to plain python: tests/test_run_dirs.py.)"""

import contextlib
import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (EXACT_DATA, EXACT_DDP, EXACT_SINGLE_STEPS, REPO, TINY, TORCHRUN, TRAIN, check, job_dir, job_numbers,
                      run_dirs, sigterm_when)
from ddp.checkpoints.checkpoint import load_checkpoint
from test_fault_tolerance import _clean_env, assert_bit_identical, last_checkpoint

# Long enough to be interrupted (dropout, augmentation and loader workers, so resuming has
# something to get wrong); a resumed run is bounded by trainer.max_steps instead. The training of
# tests/conftest.py's exact references (EXACT_DATA, no LR schedule): a resumed run bounded at a
# reference's last step ends bit-identical to it.
WORKERS = ["data.num_workers=2"]
LONG = [*EXACT_DATA, *WORKERS, "trainer.max_epochs=100000", "checkpoint.every_n_steps=5"]
LAUNCHERS = {
    "python": [sys.executable, str(TRAIN), "strategy=single"],
    "torchrun": [str(TORCHRUN), "--nproc_per_node=2", str(TRAIN), "strategy=ddp"],
}
HINT = re.compile(r"interrupted at step (\d+) \(epoch \d+\); checkpoint saved: continue with  (.+)$")


def start(command: list[str], cwd) -> subprocess.Popen:
    """In a process group of its own, as a terminal starts a foreground job; output to files."""
    return subprocess.Popen(command, cwd=cwd, env=_clean_env(), stdout=open(cwd / "stdout.txt", "w"),
                            stderr=open(cwd / "stderr.txt", "w"), start_new_session=True)


def wait_for_training(process: subprocess.Popen, cwd) -> None:
    """Until the run has saved its first periodic checkpoint: inside the training loop, steps coming.
    (A stop before the first step, on a loaded machine, may find no step within trainer.stop_deadline_s:
    tests/test_fault_tolerance.py and the worker-start test above cover the early stop.)"""
    deadline = time.monotonic() + 180
    while not list(cwd.glob("outputs/**/checkpoints/last.pt")):
        assert process.poll() is None, (cwd / "stderr.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "no periodic checkpoint: training never started"
        time.sleep(0.1)


def wait_for_file(path: Path, process: subprocess.Popen, cwd) -> None:
    """Until `path` exists, while the process lives."""
    deadline = time.monotonic() + 180
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, (cwd / "stderr.txt").read_text()[-3000:]
        time.sleep(0.1)


def ctrl_c(process: subprocess.Popen) -> None:
    """As a terminal sends it: to the whole process group."""
    os.killpg(process.pid, signal.SIGINT)


def pending_signals(pid: int) -> int:
    """The signals sent to the process that it has not taken yet (a bit mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^ShdPnd:\s*([0-9a-f]+)$", status, re.MULTILINE)[1], 16)


def finish(process: subprocess.Popen, cwd) -> tuple[int, str, str]:
    try:
        returncode = process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return returncode, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text()


# Per launcher: its run's config, the step to finish at and the reference run of that many steps
# (tests/conftest.py), and the rank slowed down. Every training forward of that rank takes SLOW_MS
# longer (fault.slow_rank, a sleep: it changes no number, and the resumed run goes without it), so the
# Ctrl-C, right after the step-5 checkpoint, comes many seconds before the last step. One process
# augments in the main process, as its reference does. Both DDP launchers (torchrun and
# strategy.nproc_per_node, with loader workers under Ctrl-C): the chain after this test.
FINISH = {"python": ([arg for arg in LONG if arg not in WORKERS], EXACT_SINGLE_STEPS, "exact_single_reference", 0)}
SLOW_MS = 500


@pytest.mark.parametrize("launcher", FINISH)
def test_ctrl_c_saves_at_the_next_step_and_the_printed_command_finishes_bit_identically(launcher, tmp_path, request):
    config, last_step, reference_fixture, slow_rank = FINISH[launcher]
    command = [*LAUNCHERS[launcher], *config, f"fault.slow_rank={slow_rank}", f"fault.slow_ms={SLOW_MS}"]
    process = start(command, tmp_path)
    wait_for_training(process, tmp_path)
    ctrl_c(process)
    returncode, stdout, stderr = finish(process, tmp_path)
    output = stdout + stderr

    (run_dir,) = run_dirs(tmp_path)
    _, resume = _ctrl_c_hint(output, run_dir, tmp_path, "python", before=last_step)
    assert returncode == 130, output[-4000:]
    assert "Traceback" not in output, output[-4000:]

    # the printed command, as a user would paste it (with this environment's python)
    resume[0] = sys.executable
    bounded = [f"trainer.max_steps={last_step}", "fault.slow_rank=-1"]
    check(subprocess.run([*resume, *bounded], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=180))
    assert_bit_identical(last_checkpoint(run_dir), request.getfixturevalue(reference_fixture)[1])


def _ctrl_c_hint(output: str, run_dir, cwd, launcher: str, before: int) -> tuple[int, list[str]]:
    """The console's one line after a Ctrl-C: the step it saved (that of last.pt, before `before`) and
    the command it prints, as a user would paste it (`launcher` first, the run dir last)."""
    hints = [HINT.search(line) for line in output.splitlines() if "checkpoint saved: continue with" in line]
    assert len(hints) == 1 and hints[0], output[-4000:]
    step, resume = int(hints[0][1]), shlex.split(hints[0][2])
    assert last_checkpoint(run_dir)["global_step"] == step
    assert step < before, f"interrupted at step {step}: too late for this test"
    assert resume[0] == launcher
    assert resume[-1] == f"resume={os.path.relpath(run_dir, cwd)}"
    return step, resume


def test_ddp_stopped_by_sigterm_ctrl_c_and_max_steps_under_both_launchers_ends_bit_identically(exact_ddp_reference, tmp_path):
    """One 2-rank run, with 2 DataLoader workers per rank (which must not die of the signals first),
    stopped four ways and resumed each time in its run dir, under torchrun and under its own launcher
    (strategy.nproc_per_node=2) in turn; run to its 2 epochs at last, it is the uninterrupted reference
    (exact_ddp_reference):
    1. torchrun, preemption: SIGTERM to torchrun reaches the workers, which finish the step, save and stop;
    2. self-launched with resume=auto, it carries on from that step; Ctrl-C saves at the next step
       after its first periodic checkpoint, exits 130, and the console prints the command that continues;
    3. that command, bounded by trainer.max_steps=13, stops mid-epoch (epoch 1, batch 5 of 8);
    4. torchrun resumes it at step 13, saving every step (checkpoint.*: no change to the training);
       Ctrl-C once it has saved step 14 saves at step 15, torchrun exits, and the console prints the
       torchrun command that continues;
    5. that command runs to the end (an extension of the max_steps stop, past one more stop).
    Rank 1's every step takes 1 s longer in the stopped ones, 3 s in the fourth (fault.slow_rank, a
    sleep: it changes no number, and the bounded and the last one run without it), so each stop comes
    long before the step that bounds it.
    On a loaded machine the first step can come late after the signal: the ranks may wait up to 45 s for
    it (trainer.stop_deadline_s), and torchrun 55 s for them (--shutdown-timeout, 30 s by default), which
    bound only a failure's wait."""
    pinned = "hydra.run.dir=outputs/run"
    max_steps = 13
    slowed = ["trainer.stop_deadline_s=45", "fault.slow_rank=1", "fault.slow_ms=1000"]
    run_dir = tmp_path / "outputs" / "run"
    log_file = run_dir / "train_rank0.log"

    # 1. SIGTERM to torchrun alone, 2 s into training
    process = start([str(TORCHRUN), "--nproc_per_node=2", "--shutdown-timeout=55", str(TRAIN), *EXACT_DDP,
                     "checkpoint.every_n_steps=100000", *slowed, pinned], tmp_path)

    def two_seconds_into_training_with_nothing_saved():
        time.sleep(2)
        assert not (run_dir / "checkpoints").exists()  # nothing saved yet: the save must come from SIGTERM

    returncode = sigterm_when(process, lambda: log_file.exists() and "global_batch=" in log_file.read_text(),
                              (tmp_path / "stderr.txt").read_text, before_signal=two_seconds_into_training_with_nothing_saved)
    logs = (tmp_path / "stdout.txt").read_text() + (tmp_path / "stderr.txt").read_text()
    assert returncode != 0, logs
    assert (run_dir / "checkpoints" / "last.pt").is_file(), f"no checkpoint after SIGTERM\n{logs[-6000:]}"
    checkpoint = last_checkpoint(run_dir)
    saved = checkpoint["global_step"]
    assert 0 < saved < 10, f"stopped at step {saved}: the SIGTERM came too late for this test"
    for rank in (0, 1):
        rank_log = (run_dir / f"train_rank{rank}.log").read_text()
        assert f"stopped by SIGTERM at step {saved}" in rank_log, rank_log

    # 2. self-launched, resume=auto carries on from there; Ctrl-C once it has saved its first periodic checkpoint
    process = start([sys.executable, str(TRAIN), *EXACT_DDP, "strategy.nproc_per_node=2", *slowed, pinned, "resume=auto"], tmp_path)
    wait_for_file(run_dir / "checkpoints" / f"step-{(saved // 5 + 1) * 5:08d}.pt", process, tmp_path)
    ctrl_c(process)
    returncode, stdout, stderr = finish(process, tmp_path)
    output = stdout + stderr
    assert re.search(rf"resumed from \S+ at epoch {checkpoint['epoch']}, batch {checkpoint['batch_in_epoch']}, step {saved}\b",
                     output), output[-4000:]
    _, resume = _ctrl_c_hint(output, run_dir, tmp_path, "python", before=max_steps)
    assert returncode == 130, output[-4000:]
    assert "Traceback" not in output, output[-4000:]

    # 3. the printed command, as a user would paste it (with this environment's python), bounded
    resume[0] = sys.executable
    check(subprocess.run([*resume, f"trainer.max_steps={max_steps}", "fault.slow_rank=-1"], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, timeout=180))
    stopped = last_checkpoint(run_dir)
    assert (stopped["epoch"], stopped["batch_in_epoch"], stopped["global_step"]) == (1, 5, max_steps)

    # 4. torchrun resumes it at step 13; Ctrl-C once it has saved step 14
    process = start([str(TORCHRUN), "--nproc_per_node=2", str(TRAIN), *EXACT_DDP, *slowed, "fault.slow_ms=3000",
                     "checkpoint.every_n_steps=1", pinned, "resume=outputs/run"], tmp_path)
    wait_for_file(run_dir / "checkpoints" / f"step-{max_steps + 1:08d}.pt", process, tmp_path)
    ctrl_c(process)
    returncode, stdout, stderr = finish(process, tmp_path)
    output = stdout + stderr
    assert re.search(rf"resumed from \S+ at epoch 1, batch 5, step {max_steps}\b", stdout), output[-4000:]
    _, resume = _ctrl_c_hint(output, run_dir, tmp_path, "torchrun", before=16)
    # torchrun exits 1 with its own SignalException traceback, once its workers have saved.
    assert returncode == 1 and "SignalException" in stderr, output[-4000:]
    assert f'File "{TRAIN}"' not in output, output[-4000:]

    # 5. the printed command, as a user would paste it (with this environment's torchrun), to the end
    resume[0] = str(TORCHRUN)
    check(subprocess.run([*resume, "fault.slow_rank=-1"], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                         timeout=180))
    assert_bit_identical(last_checkpoint(run_dir), exact_ddp_reference[1])


def test_a_stop_while_a_loader_worker_is_still_starting_exits_without_a_traceback(tmp_path):
    """Under load a Ctrl-C can land at step 1, while a loader worker is still starting (unpickling
    its queues). The stop still exits 130 with nothing on the console but its own lines."""
    script = REPO / "tests" / "workers" / "stop_while_a_loader_worker_starts.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "started")], cwd=REPO,
                            env=_clean_env() | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "a worker was still starting: True", result.stdout + result.stderr
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_second_ctrl_c_exits_at_once_and_the_saved_checkpoint_still_loads(tmp_path):
    # The second Ctrl-C goes 5 ms after the first has reached the process (two signals still pending
    # together are one). Each step takes 200 ms longer (fault.slow_rank), so the second one lands
    # before the step boundary where the first would save. A run may still save and exit before it,
    # or take both in one C call: that is the first Ctrl-C's path, checked as such; try again.
    for attempt in range(5):
        cwd = tmp_path / str(attempt)
        cwd.mkdir()
        process = start([*LAUNCHERS["python"], *LONG, "fault.slow_rank=0", "fault.slow_ms=200"], cwd)
        wait_for_training(process, cwd)  # and a periodic checkpoint to keep intact
        started = time.monotonic()
        ctrl_c(process)
        while pending_signals(process.pid) & (1 << (signal.SIGINT - 1)):
            time.sleep(0.0005)
        time.sleep(0.005)
        ctrl_c(process)
        returncode, stdout, stderr = finish(process, cwd)
        assert returncode == 130, stdout + stderr
        assert "Traceback" not in stdout + stderr
        (run_dir,) = run_dirs(cwd)
        if "checkpoint saved: continue with" in stdout + stderr:
            assert "interrupted again" not in stderr, stdout + stderr
            continue
        assert time.monotonic() - started < 15
        assert re.search(r"^error: interrupted again: exiting at once", stderr, re.MULTILINE), stderr
        assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["global_step"] > 0
        return
    pytest.fail("in 5 attempts, every run had saved and exited before its second Ctrl-C")


def test_ctrl_c_in_a_sweep_marks_the_job_interrupted_and_starts_no_other(tmp_path):
    # No loader workers: what the sweep does with the interrupted job doesn't depend on them (the first test's do).
    without_workers = [arg for arg in LONG if arg not in WORKERS]
    process = start([sys.executable, str(TRAIN), "-m", "strategy=single", *without_workers, "data.batch_size=8,16"], tmp_path)
    wait_for_training(process, tmp_path)
    ctrl_c(process)
    returncode, stdout, stderr = finish(process, tmp_path)
    assert returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    assert job_numbers(sweep) == [0]  # job 1 never started
    with open(sweep / "summary.csv") as f:
        (row,) = csv.DictReader(f)
    assert (row["job"], row["status"]) == ("0", "interrupted")
    assert "sweep summary" in stdout and "interrupted" in stdout
    assert last_checkpoint(job_dir(sweep, 0))["global_step"] > 0


def _gone(pid: int) -> bool:
    """The process has exited (a zombie its parent hasn't reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_to_a_rank_blocked_in_a_collective_exits_within_the_stop_deadline(tmp_path):
    """Rank 1 stalls after step 3 (fault.stall_rank), so rank 0 waits in step 4's gradient all_reduce,
    where Python runs no signal handler until the collective returns (here: strategy.timeout_s).
    SIGTERM to rank 0 alone: it exits 143 within trainer.stop_deadline_s, without a checkpoint."""
    deadline_s = 2
    command = [*LAUNCHERS["torchrun"], *TINY, "trainer.max_epochs=100000", "fault.stall_rank=1", "fault.at_step=3",
               f"trainer.stop_deadline_s={deadline_s}", "strategy.timeout_s=120"]
    process = start(command, tmp_path)
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not any("stalling at step 3" in log.read_text() for log in tmp_path.glob("outputs/*/train_rank1.log")):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(0.05)
        (run_dir,) = run_dirs(tmp_path)
        workers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        rank0 = int(re.match(r"pid (\d+)", (run_dir / ".lock").read_text())[1])
        sent = time.monotonic()
        os.kill(rank0, signal.SIGTERM)
        while not _gone(rank0) and time.monotonic() - sent < deadline_s + 10:
            time.sleep(0.01)
        took = time.monotonic() - sent
        assert deadline_s <= took < deadline_s + 3, f"rank 0 exited {took:.1f} s after its SIGTERM"
        log = (run_dir / "train_rank0.log").read_text()
        assert f"SIGTERM: no step boundary within {deadline_s} s, exiting without a checkpoint" in log, log[-3000:]
        assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("*.pt"))
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, _, stderr = finish(process, tmp_path)
    assert f"exitcode  : 143 (pid: {rank0})" in stderr, stderr[-3000:]
