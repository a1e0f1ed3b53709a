"""Fault tolerance, with real torchrun processes (CPU, gloo): what survives a killed, raising,
stalled or preempted rank, an interrupted checkpoint save, and a bad checkpoint.

"Bit-identical" means torch.equal on every tensor of the model and optimizer state, and the same
position and per-rank torch/loader RNG state and epoch totals, in the final `last.pt`, against one
uninterrupted reference run (`assert_bit_identical`; the references are tests/conftest.py's
`exact_ddp_reference` and `exact_single_reference`, which tests/test_interrupts.py compares with too).

Determinism (the same config twice gives the same run) has no run of its own: every resumed run
below trained its first steps afresh and continued from a checkpoint that those fresh steps wrote,
with the same code that a fresh run trains with; so it ends bit-identical to the reference only if
the fresh steps were (the killed and the corrupted-checkpoint runs, 2 ranks; the max_steps
extension, 1 process; tests/test_interrupts.py's Ctrl-C and SIGTERM runs). The one-process runs
here (the reference, the max_steps stop and its extensions) are train.run in a test process: a
launch would cost more start-up than the run; tests/test_interrupts.py's Ctrl-C'd `python train.py`
is a process of its own that must end equal to that reference too.
"""

import ast
import json
import logging
import os
import pickletools
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import EXACT_DATA as DATA
from conftest import EXACT_DDP as EXACT
from conftest import EXACT_SINGLE as EXTEND
from conftest import (EXACT_SINGLE_STEPS, REPO, TORCHRUN, TRAIN, check, config_error_in_this_process, last_checkpoint,
                      run_dirs, run_in_this_process, shared_run_in_this_process)
from ids_and_noise import IdsAndNoise
from ddp.checkpoints.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_step_checkpoint
from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_train_loader, iterate_from, start_epoch
from models.resnet import build_resnet18
from models.small_cnn import SmallCNN

# gloo worker restarts need a store that isn't shared with the agent (stale keys otherwise, pytorch#135712).
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# EXACT (tests/conftest.py): dropout (global RNG, per rank), random augmentation in 2 DataLoader
# workers and a shuffled sampler, 2 ranks x 8 batches x 2 epochs = 16 steps. DATA: its data and model.
# For the runs whose property doesn't need loader workers (each rank's worker server costs a start-up).
EXACT_NO_WORKERS = [arg for arg in EXACT if not arg.startswith("data.num_workers=")] + ["data.num_workers=0"]
# One process, for the runs that must stop before training: no torchrun start-up to pay for.
SINGLE = ["strategy=single", *DATA, "trainer.max_epochs=1"]
# What must be equal after a resume; `config` differs by the fault.*/resume keys.
# A job that failed fast ends well within this; one waiting for the process group's default timeout
# (strategy.timeout_s=1800) would not. Generous, so that a loaded machine doesn't fail the test.
NO_HANG_S = 300
STATE_KEYS = ("model", "optimizer", "epoch", "batch_in_epoch", "global_step", "tensorboard_step", "world_size", "ranks")


def torchrun(args: list[str], cwd: Path, max_restarts: int = 0, timeout: float = 180):
    """train.py on 2 ranks, restartable store, `--max-restarts` as given."""
    command = [str(TORCHRUN), "--nproc_per_node=2", f"--max-restarts={max_restarts}", str(TRAIN), *args]
    return subprocess.run(command, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)


def _clean_env() -> dict:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONUNBUFFERED": "1"} | RESTARTABLE


def output(result) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{result.stderr[-8000:]}"


def assert_same_state(actual, expected, where: str = "checkpoint") -> None:
    """Nested dicts/lists/tuples of tensors and plain values, compared exactly (torch.equal, same dtype)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, expected a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), f"{where}: {actual.dtype}{list(actual.shape)} vs {expected.dtype}{list(expected.shape)}"
        assert torch.equal(actual, expected), f"{where}: values differ (max abs diff {(actual.double() - expected.double()).abs().max().item():g})"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}, expected a dict"
        assert actual.keys() == expected.keys(), f"{where}: keys {sorted(map(str, actual))} vs {sorted(map(str, expected))}"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r} vs {expected!r}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} vs {expected!r}"


def assert_bit_identical(checkpoint: dict, reference: dict) -> None:
    assert_same_state(_comparable(checkpoint), _comparable(reference))


def _comparable(checkpoint: dict) -> dict:
    """Everything a resume must reproduce. Python's `random` is left out: `seed` doesn't seed it, so
    even two fresh runs differ there (nothing in the main process draws from it)."""
    state = {k: checkpoint[k] for k in STATE_KEYS}
    state["ranks"] = [{k: v for k, v in rank.items() if k != "python_rng"} for rank in state["ranks"]]
    return state


def rank_log(run_dir: Path, rank: int) -> str:
    return (run_dir / f"train_rank{rank}.log").read_text()


@pytest.fixture(scope="module")
def reference(exact_ddp_reference):
    """EXACT uninterrupted (16 steps): (run dir, final last.pt)."""
    return exact_ddp_reference


# 1, 2 ------------------------------------------------------------------------------------------
# (Determinism, once a run of its own: the module docstring says why every resume test covers it.)

@pytest.fixture(scope="module")
def killed_and_resumed(killed_and_restarted):
    """SIGKILL on rank 1 at step 7 (after the step-5 checkpoint), one restart allowed: (run dir, its
    console's stdout, its stderr). Before the restart another launch runs in the same working dir (the run is
    tests/conftest.py's, which tests/test_run_dirs.py reads too): the run dir survives the restart
    all the same, one dir, not one per attempt."""
    return killed_and_restarted


def test_killed_rank_is_restarted_and_ends_bit_identical(reference, killed_and_resumed):
    """torchrun restarts both workers once, they resume from step 5 in the same run dir, and the
    run ends exactly where the uninterrupted one does. Rank 0, whose collective failed when rank 1 ended, says so in one
    line, without a traceback."""
    run_dir, stdout, stderr = killed_and_resumed
    assert_bit_identical(last_checkpoint(run_dir), reference[1])

    logs = [rank_log(run_dir, rank) for rank in (0, 1)]
    assert logs[1].count("fault.kill_rank=1: killing this rank at step 7") == 1, logs[1]
    for text in logs:  # each rank's log is appended across the two attempts
        assert text.count("process group up") == 2, text
        resumed = re.findall(r"resumed from (\S+) at epoch 0, batch 5, step 5", text)
        assert resumed == [str(run_dir / "checkpoints" / "last.pt")], text
        assert text.count("resumed from") == 1, text
    assert stdout.count("resumed from") == 1, stdout[-5000:]  # console: rank 0 only
    lost_peer = "error: rank 0: another rank ended during a collective, so this one stops too (gloo: "
    assert stderr.count(lost_peer) == 1 and "Traceback" not in stderr and "Error executing job" not in stderr, stderr[-5000:]


def test_tensorboard_has_every_step_once_after_kill_and_resume(reference, killed_and_resumed):
    """The first attempt logged steps past the checkpoint; the resumed one purges them, so a
    reader sees each train/loss step exactly once, with the same values as the reference."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = killed_and_resumed
    event_files = sorted(run_dir.glob("events.out.tfevents*"))
    assert len(event_files) == 2, event_files  # one per attempt

    first = EventAccumulator(str(event_files[0]))
    first.Reload()
    assert max(e.step for e in first.Scalars("train/loss")) > 5, "the killed attempt logged nothing past step 5: nothing to purge"

    def losses(path):
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        return [(e.step, e.value) for e in accumulator.Scalars("train/loss")]

    resumed, uninterrupted = losses(run_dir), losses(reference[0])
    assert [step for step, _ in resumed] == list(range(1, 17)), resumed
    assert resumed == uninterrupted


# 3, 5, 6 ---------------------------------------------------------------------------------------

def test_exhausted_restart_budget_fails_names_the_raising_rank_keeps_the_last_checkpoint_and_a_corrupt_one_falls_back(reference, tmp_path):
    """Rank 1 raises at step 12 on every attempt; after the one allowed restart (which resumed from
    step 10) torchrun gives up fast (well within NO_HANG_S, not strategy.timeout_s) and names that rank
    and its error as the root cause (rank 0's lost peer adds no traceback), and the checkpoints of steps 5 and 10 are intact. Then last.pt is
    corrupted: resume=auto skips it (and step 10, the same file), resumes from step 5 and ends
    bit-identical to the reference. (One run for three stories: a raising rank, a restart budget used up,
    and a failure that leaves checkpoints behind. A SIGKILLed rank and its restart: test 1 above.)"""
    pinned = "hydra.run.dir=outputs/run"
    # keep_best=0: the validation at step 8 would add a step-8 checkpoint (and best-8), another fallback
    result = torchrun([*EXACT, pinned, "checkpoint.keep_best=0", "fault.raise_rank=1", "fault.at_step=12", "fault.every_attempt=true"],
                      tmp_path, max_restarts=1, timeout=NO_HANG_S)
    assert result.returncode != 0, output(result)
    assert "Root Cause" in result.stderr, output(result)
    root_cause = result.stderr.split("Root Cause", 1)[1].split("=" * 20, 1)[0]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), root_cause
    assert "RuntimeError: injected fault: fault.raise_rank=1 at step 12" in root_cause, root_cause
    # rank 0, whose collective failed when rank 1 ended, adds no traceback of its own, nor one to torchrun's summary
    assert "gloo/transport/tcp" not in result.stderr, output(result)
    run_dir = tmp_path / "outputs" / "run"
    for rank in (0, 1):
        assert rank_log(run_dir, rank).count("process group up") == 2  # two attempts
        assert rank_log(run_dir, rank).count("at epoch 1, batch 2, step 10") == 1  # the restart resumed from step 10
    directory = run_dir / "checkpoints"
    # no step-15 checkpoint: the restart died at step 12 too
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt", "step-00000010.pt"]
    for name, position in (("last.pt", (1, 2, 10)), ("step-00000010.pt", (1, 2, 10)), ("step-00000005.pt", (0, 5, 5))):
        checkpoint = torch.load(directory / name, weights_only=True)
        assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == position
        SmallCNN(num_classes=10, in_channels=3, channels=[8, 16], dropout=0.3).load_state_dict(checkpoint["model"], strict=True)

    last = directory / "last.pt"
    assert last.stat().st_ino == (directory / "step-00000010.pt").stat().st_ino  # a hardlink
    with open(last, "r+b") as f:  # truncating in place corrupts step-10 as well: step 5 is the fallback
        f.truncate(last.stat().st_size // 2)

    result = torchrun([*EXACT, pinned, "checkpoint.keep_best=0", "resume=auto"], tmp_path)
    check(result)
    warnings = [line for line in result.stdout.splitlines() if "skipping checkpoint" in line]
    assert any(str(last) in line for line in warnings), output(result)
    assert any(str(directory / "step-00000010.pt") in line for line in warnings), output(result)
    assert f"resumed from {directory / 'step-00000005.pt'} at epoch 0, batch 5, step 5" in result.stdout, output(result)
    assert_bit_identical(last_checkpoint(run_dir), reference[1])


# 4 ---------------------------------------------------------------------------------------------

def _state(value: float, size: int = 1000) -> dict:
    return {"model": {"w": torch.full((size,), float(value))}, "global_step": int(value)}


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".*.tmp"))


class _RaisesWhenPickled:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_save_that_fails_while_pickling_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    save_step_checkpoint(_state(5), tmp_path, 5, keep_last=3)
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        save_step_checkpoint({**_state(10), "bad": [_RaisesWhenPickled()]}, tmp_path, 10, keep_last=3)
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt"]
    for name in ("last.pt", "step-00000005.pt"):
        assert_same_state(load_checkpoint(directory / name), _state(5))
    # save_checkpoint alone, over an existing file
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        save_checkpoint({"bad": _RaisesWhenPickled()}, directory / "last.pt")
    assert_same_state(load_checkpoint(directory / "last.pt"), _state(5))
    assert _temp_files(directory) == []


def _run_python(code: str, *args: str, timeout: float = 60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=os.environ | {"PYTHONPATH": str(REPO)})


def test_save_that_hits_the_file_size_limit_raises_and_keeps_the_previous_checkpoint(tmp_path):
    """RLIMIT_FSIZE below the new file's size, SIGXFSZ ignored: the write fails (like a full disk)."""
    result = _run_python("""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from ddp.checkpoints.checkpoint import save_step_checkpoint
        run_dir = Path(sys.argv[1])
        save_step_checkpoint({"model": {"w": torch.full((1000,), 5.0)}, "global_step": 5}, run_dir, 5, 3)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
        try:
            save_step_checkpoint({"model": {"w": torch.ones(1_000_000)}, "global_step": 10}, run_dir, 10, 3)
        except Exception as error:
            print("save raised", type(error).__name__, error)
            sys.exit(0)
        print("save did not raise")
        sys.exit(3)
    """, str(tmp_path))
    assert result.returncode == 0 and "save raised" in result.stdout, output(result)
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt"]  # no temp file, no step-10
    for name in ("last.pt", "step-00000005.pt"):
        assert_same_state(load_checkpoint(directory / name), _state(5))


def test_save_killed_midway_keeps_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    """SIGKILL while a 128 MiB save is being written: no code runs, so its temp file stays, but the
    previous checkpoint is untouched; the next save removes the stale temp file."""
    directory = tmp_path / "checkpoints"
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from pathlib import Path
            import torch
            from ddp.checkpoints.checkpoint import save_step_checkpoint
            run_dir = Path(sys.argv[1])
            save_step_checkpoint({"model": {"w": torch.full((1000,), 5.0)}, "global_step": 5}, run_dir, 5, 3)
            big = {"model": {"w": torch.ones(32 * 2**20)}, "global_step": 10}
            print("saved", flush=True)
            save_step_checkpoint(big, run_dir, 10, 3)
            print("second save finished", flush=True)
        """), str(tmp_path)],
        cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            partial = [p for p in directory.glob(".step-00000010.pt.*.tmp") if p.stat().st_size > 0]
            if partial:
                process.send_signal(signal.SIGKILL)
                break
            assert process.poll() is None, process.communicate()
            time.sleep(0.002)
        else:
            pytest.fail("the second save never started writing")
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == -signal.SIGKILL, (stdout, stderr)
    assert "second save finished" not in stdout
    left = _temp_files(directory)
    assert len(left) == 1 and left[0].startswith(".step-00000010.pt."), left  # killed inside the save
    assert sorted(p.name for p in directory.glob("*.pt")) == ["last.pt", "step-00000005.pt"]
    for name in ("last.pt", "step-00000005.pt"):
        assert_same_state(load_checkpoint(directory / name), _state(5))

    save_step_checkpoint(_state(10), tmp_path, 10, keep_last=3)
    assert _temp_files(directory) == []
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt", "step-00000010.pt"]
    assert_same_state(load_checkpoint(directory / "last.pt"), _state(10))
    assert_same_state(load_checkpoint(directory / "step-00000005.pt"), _state(5))


# 5: with 3 above (the exhausted run's checkpoints are the ones corrupted).


# 6: with 3 above (its rank 1 raises; torchrun names it as the root cause).


# 7 ---------------------------------------------------------------------------------------------

# A run on a disk of its own that fills up: a tmpfs of 1000 KiB mounted in a mount namespace of this
# script's own (nothing outlives it, whatever happens to the test), in `disk/` of the working dir. The
# run's first checkpoint (about 640 KB, with the optimizer's momentum) fits, the second doesn't. Then
# the tmpfs grows to 64 MiB (space freed) and the command the error printed runs (with RESUME=1). What
# each step left is copied out for the test to read.
FULL_DISK_SCRIPT = r"""
mkdir disk && mount -t tmpfs -o size=1000k tmpfs disk && cd disk || exit 10
$LAUNCH "$TRAIN" "$@" 2>"$OUT/full.err"; echo $? >"$OUT/full.rc"
mkdir "$OUT/left" && cp -a outputs "$OUT/left/"
[ "$RESUME" = 1 ] || exit 0
mount -o remount,size=64m tmpfs "$PWD" || exit 11
command=$(sed -n 's/.*continue with  //p' "$OUT/full.err")
[ -n "$command" ] || exit 12
eval "$command" 2>"$OUT/resumed.err"; echo $? >"$OUT/resumed.rc"
mkdir "$OUT/resumed" && cp -a outputs "$OUT/resumed/"
"""
# 12 steps of 8 samples per rank: saves at steps 4 (fits), 8 (doesn't) and 12.
FULL_DISK_RUN = ["data=synthetic", "data.num_val_samples=8", "data.image_size=8", "data.batch_size=8",
                 "model.channels=[64,128]", "trainer.max_epochs=1", "checkpoint.every_n_steps=4", "checkpoint.keep_best=0"]


@pytest.mark.parametrize("launch, ranks, strategy", [
    ("python", 1, ["strategy=single"]),
    ("torchrun --nproc_per_node=2", 2, ["strategy=ddp"]),
    ("python", 2, ["strategy=ddp", "strategy.nproc_per_node=2"]),  # self-launched: the launcher prints the line
    ("torchrun --nproc_per_node=2", 2, ["strategy=fsdp"]),  # every rank writes its shards into one dir
], ids=["python", "torchrun", "self-launched", "fsdp"])
def test_a_full_disk_at_a_save_is_one_line_with_the_command_that_resumes_once_space_is_freed(tmp_path, launch, ranks, strategy):
    """A real full disk at the step-8 save: torch's own error hides the errno ("unexpected pos ..."),
    yet the run ends with exit 1 and one line naming the path, the cause, the free space and the
    command that resumes, once: under torchrun by rank 0 (rank 0 saves; the others get its word instead
    of a lost peer and exit 1 without a line; under fsdp, DCP tells every rank of any rank's failed shard), by a
    self-launching process; the step-4 checkpoint is intact and no temp file or dir is left. Once space is freed, that
    command continues the run to its end (run for one process, and for fsdp's sharded checkpoint)."""
    sharded = "strategy=fsdp" in strategy
    suffix = "" if sharded else ".pt"  # a sharded checkpoint is a dir
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    env = _clean_env() | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "TRAIN": str(TRAIN),
                          "OUT": str(tmp_path), "LAUNCH": launch,
                          "RESUME": str(int(ranks == 1 or sharded))}
    script = subprocess.run([*namespace, "bash", "-c", FULL_DISK_SCRIPT, "full-disk", *FULL_DISK_RUN,
                             f"data.num_samples={96 * ranks}", *strategy], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    error = (tmp_path / "full.err").read_text() if (tmp_path / "full.err").exists() else ""
    assert script.returncode == 0, output(script) + error[-4000:]
    assert (tmp_path / "full.rc").read_text().strip() == "1", error
    lines = [line for line in error.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, error[-8000:]  # under torchrun, rank 0's: every rank raises it
    if not launch.startswith("torchrun"):
        assert error.splitlines() == lines  # nothing else: no traceback, no torch enforce message
    assert "inline_container" not in error and "Connection reset" not in error, error[-8000:]
    (run_dir,) = run_dirs(tmp_path / "left")
    assert re.fullmatch(rf"error: saving {tmp_path}/disk/outputs/{run_dir.name}/checkpoints/step-00000008{suffix} failed: "
                        r"no space left on device \(\S+ has \d+\.\d MB free, and the save needs more than the \d+\.\d MB it "
                        rf"wrote\); what was saved before is intact: free some space, then continue with  {launch} \S+/train.py "
                        rf".*checkpoint.keep_best=0 data.num_samples={96 * ranks} {' '.join(strategy)} resume=outputs/{run_dir.name}", lines[0]), lines[0]
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ([] if sharded else ["last.pt"]) + [f"step-00000004{suffix}"]
    assert load_checkpoint(checkpoints / f"step-00000004{suffix}")["global_step"] == 4
    if ranks > 1 and not sharded:
        return  # a resume with 2 DDP ranks is no different (the killed runs above): one process runs the printed command
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", (tmp_path / "resumed.err").read_text()[-4000:]
    (resumed,) = run_dirs(tmp_path / "resumed")
    assert resumed.name == run_dir.name and json.loads((resumed / "results.json").read_text())["steps"] == 12


def test_stalled_rank_fails_the_job_after_the_process_group_timeout(tmp_path):
    # stop_deadline_s: torchrun stops the stalled rank with SIGTERM once the other has failed, and a rank
    # that reaches no step boundary waits that long before it exits (the wait has its own test).
    result = torchrun([*EXACT_NO_WORKERS, "fault.stall_rank=1", "fault.at_step=3", "strategy.timeout_s=5",
                       "trainer.stop_deadline_s=1"], tmp_path, timeout=NO_HANG_S)
    assert result.returncode != 0, output(result)
    assert "a collective timed out after strategy.timeout_s=5" in result.stderr, output(result)


# 8 ---------------------------------------------------------------------------------------------

class _CreatesFileWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _malicious_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"model": {"w": torch.zeros(2)}, "payload": _CreatesFileWhenUnpickled(marker)}, path)
    return path


def test_checkpoint_with_pickled_code_is_refused_and_never_run(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    evil = _malicious_checkpoint(tmp_path / "evil.pt", marker)
    # The payload is real (read without unpickling): the pickle calls os.system with the touch command.
    with zipfile.ZipFile(evil) as archive:
        (pickle_name,) = [name for name in archive.namelist() if name.endswith("data.pkl")]
        arguments = {arg for _, arg, _ in pickletools.genops(archive.read(pickle_name)) if isinstance(arg, str)}
    assert f"{os.system.__module__} system" in arguments and f"touch {marker}" in arguments, arguments
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(evil)
    assert not marker.exists()

    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process([*SINGLE, f"resume={evil}"], tmp_path / "run")
    assert "refused" in line and str(evil) in line, line
    assert not marker.exists()


# 9 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [1, 4, 6])
def test_mid_epoch_resume_loads_exactly_the_remaining_samples(start):
    """2 workers, rank 1 of 2: 25 samples in 7 batches. Resuming at batch `start` on a fresh loader
    started at that batch's first sample yields batch indices start.. with the same ids and the same
    random draws as the full pass, and loads no sample of the batches before it (at 6 of 7: 85% in)."""
    env = DistEnv(rank=1, world_size=2, local_world_size=2, launcher="torchrun")
    data_cfg = SimpleNamespace(batch_size=4, num_workers=2)
    seed, epoch = 0, 1

    def fresh_loader(samples_in_epoch: int = 0):
        loader = build_train_loader(IdsAndNoise(), data_cfg, env, seed, pin_memory=False)
        start_epoch(loader, epoch, samples_in_epoch)
        return loader

    full = list(fresh_loader())
    assert len(full) == 7
    expected = DistributedSampler(range(50), num_replicas=2, rank=1, shuffle=True, seed=seed)
    expected.set_epoch(epoch)
    assert torch.cat([ids for ids, _ in full]).tolist() == list(expected)

    loader = fresh_loader(start * data_cfg.batch_size * env.world_size)
    resumed = list(iterate_from(loader, start))
    assert [index for index, _ in resumed] == list(range(start, 7))
    ids = torch.cat([ids for ids, _ in full[:start]] + [ids for _, (ids, _) in resumed])
    assert ids.tolist() == list(expected)
    for (ids, noise), (_, (resumed_ids, resumed_noise)) in zip(full[start:], resumed):
        assert torch.equal(resumed_ids, ids) and torch.equal(resumed_noise, noise)
    loads = loader.dataset.dataset.loads
    assert loads[torch.cat([ids for ids, _ in full[:start]])].sum() == 0
    assert loads[torch.cat([ids for ids, _ in full[start:]])].tolist() == [1] * (len(expected) - start * 4)


# 10 --------------------------------------------------------------------------------------------

def _torch_mismatch(model, state: dict) -> tuple[list, list, list]:
    """What torch's own strict load_state_dict reports: missing, unexpected and reshaped keys."""
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(state, strict=True)
    message = str(error.value)

    def keys(label: str) -> list[str]:
        found = re.search(rf"{label}: (.*?)\.\s", message)
        return sorted(re.findall(r'"([^"]+)"', found.group(1))) if found else []

    return keys("Missing key\\(s\\) in state_dict"), keys("Unexpected key\\(s\\) in state_dict"), sorted(re.findall(r"size mismatch for ([^:]+):", message))


@pytest.mark.parametrize("model_args, model", [
    (["model.channels=[8,32]", "model.dropout=0.3"], lambda: SmallCNN(num_classes=10, in_channels=3, channels=[8, 32])),
    (["model=resnet18"], lambda: build_resnet18(num_classes=10, in_channels=3, small_input=True)),
], ids=["different_shapes", "different_keys"])
def test_resume_into_a_different_model_is_one_error_line(reference, tmp_path, monkeypatch, model_args, model):
    source = reference[0] / "checkpoints" / "last.pt"
    args = [arg for arg in SINGLE if not arg.startswith("model.")]
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process([*args, *model_args, f"resume={source}"], tmp_path / "run")
    assert str(source) in line, line
    def listed(kind: str) -> tuple[int, list[str]]:
        """`N <kind> keys ['a', 'b', 'c', ...]`: the count and the first keys named (none: 0, [])."""
        found = re.search(rf"(\d+) {kind} keys? \[(.*?)(?:, \.\.\.)?\]", line)
        return (int(found.group(1)), ast.literal_eval(f"[{found.group(2)}]")) if found else (0, [])

    torch_missing, torch_unexpected, torch_reshaped = _torch_mismatch(model(), reference[1]["model"])
    assert torch_missing or torch_unexpected or torch_reshaped
    for kind, keys in (("unexpected", torch_unexpected), ("reshaped", torch_reshaped)):
        assert listed(kind) == (len(keys), keys[:3]), line
    # torch fills in a missing BatchNorm num_batches_tracked by itself; a resume names it too
    missing_count, missing = listed("missing")
    assert missing_count >= len(torch_missing) and len(missing) == min(missing_count, 3), line
    assert all(key in torch_missing or key.endswith(".num_batches_tracked") for key in missing), line
    assert not list(tmp_path.rglob("events.out.tfevents*"))


# 11 --------------------------------------------------------------------------------------------

# SIGTERM to torchrun (preemption), then resumed: tests/test_interrupts.py, in one chain with Ctrl-C
# under torchrun, a max_steps stop mid-epoch and the extension to the end (bit-identical).


def test_sigterm_to_the_rank_process_group_never_kills_loader_workers():
    """torchrun signals a rank's whole process group. The signal may land while the rank is starting
    its loader workers (every epoch); the rank must still be the one that decides when to stop."""
    script = REPO / "tests" / "workers" / "loader_under_sigterm.py"
    rng = random.Random(0)
    for trial in range(4):
        rank = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=_clean_env() | {"PYTHONPATH": str(REPO)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert rank.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.3, 1.0))
        os.killpg(rank.pid, signal.SIGTERM)
        stdout, stderr = rank.communicate(timeout=60)
        assert rank.returncode == 0 and "stopped cleanly" in stdout, f"trial {trial}: {stderr[-2000:]}"



def test_a_rank_killed_hard_leaves_no_loader_process_behind():
    """Loader workers (and the fork server that starts them) hold the rank's stdout: it reaches EOF
    only when every one of them has exited too."""
    script = REPO / "tests" / "workers" / "loader_under_sigterm.py"
    rank = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=_clean_env() | {"PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert rank.stdout.readline().strip() == "ready"
    time.sleep(1)  # workers of some epoch are running
    rank.kill()
    try:
        rank.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(rank.pid, signal.SIGKILL)  # the server, if it is left
        raise

# 12 --------------------------------------------------------------------------------------------

def test_resume_from_a_missing_path_starts_nothing(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "last.pt"
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process([*SINGLE, f"resume={missing}"], tmp_path / "run")
    assert str(missing) in line and "not found" in line, line
    assert not list(tmp_path.rglob("events.out.tfevents*"))
    assert not list(tmp_path.rglob("*.pt"))


# 13 --------------------------------------------------------------------------------------------
# EXTEND (tests/conftest.py): one process, 16 steps per epoch (128 samples, batch 8), dropout,
# augmentation in the main process.


@pytest.fixture(scope="module")
def stopped_at_step_5(tmp_path_factory):
    """A run cut short by trainer.max_steps=5, a third of the way into its first epoch: its run dir.
    Run once for all test processes (conftest.shared_run), by train.run in a test process; tests copy
    it before they resume it."""
    return shared_run_in_this_process("fault_tolerance_max_steps_5", [*EXTEND, "trainer.max_steps=5"], tmp_path_factory)


def test_a_max_steps_stop_mid_epoch_records_where_it_stopped(stopped_at_step_5):
    checkpoint = last_checkpoint(stopped_at_step_5)
    assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (0, 5, 5)
    results = json.loads((stopped_at_step_5 / "results.json").read_text())
    assert (results["steps"], results["epochs"]) == (5, 0)  # no epoch completed
    assert results["epoch_progress"] == 5 / 16


def test_extending_a_max_steps_run_is_bit_identical_to_running_that_long(stopped_at_step_5, exact_single_reference, tmp_path,
                                                                         monkeypatch, caplog):
    """Train 5 steps, look, then resume the run dir with a larger max_steps, twice: to step 10, within
    the epoch, then to step 20, across an epoch boundary: the same as 20 steps straight
    (exact_single_reference). Without loader workers the augmentation draws from the global RNG as
    each batch loads: a run stopped by max_steps must load no batch past its last update, or its
    checkpoint holds the RNG after a draw that the run never trained on, and the extended run draws
    differently (and so does every later step, up to the end compared here).
    Each part by train.run in this process (the launches of the same story: 2 ranks with loader
    workers, a max_steps stop mid-epoch extended to the end, in tests/test_interrupts.py)."""
    extended = tmp_path / "extended" / "run"
    shutil.copytree(stopped_at_step_5, extended)
    monkeypatch.chdir(extended.parent)
    for start, steps in ((5, 10), (10, EXACT_SINGLE_STEPS)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            run_in_this_process([*EXTEND, f"trainer.max_steps={steps}", f"resume={extended}"], extended)
        assert f"at epoch 0, batch {start}, step {start}" in caplog.text, caplog.text
    assert_bit_identical(last_checkpoint(extended), exact_single_reference[1])


def test_a_ranks_error_file_is_whole_or_absent_whenever_torchrun_may_read_it(tmp_path, monkeypatch):
    """The traceback a failing rank records for torchrun (train.py's @record) is never seen empty or cut:
    torch's own handler opens the file, emptying it, then writes, and torchrun, parsing an empty file of a
    rank it stopped meanwhile, ended the job instead of restarting it. A thread records a large exception
    over and over while this one reads the file: every read is torch's whole JSON, which torchrun parses."""
    import threading

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddp.jobs.failures import WholeErrorFile

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    message = "x" * (4 << 20)
    done = threading.Event()

    def record_again_and_again() -> None:
        handler = WholeErrorFile()
        for _ in range(20):
            handler.record_exception(RuntimeError(message))
        done.set()

    threading.Thread(target=record_again_and_again, daemon=True).start()
    reads = 0
    while not done.is_set():
        if error_file.exists():
            assert json.loads(error_file.read_text())["message"]["message"] == f"RuntimeError: {message}"
            reads += 1
    assert reads > 0
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == f"RuntimeError: {message}"
