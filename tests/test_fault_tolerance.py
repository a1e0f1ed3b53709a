"""Fault tolerance, with real torchrun processes (CPU, gloo): what survives a killed, raising,
stalled or preempted rank, an interrupted checkpoint save, and a bad checkpoint.

"Bit-identical" means torch.equal on every tensor of the model and optimizer state, and the same
position and per-rank torch/loader RNG state and epoch totals, in the final `last.pt`, against one
uninterrupted reference run (`assert_bit_identical`).
"""

import ast
import json
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

from conftest import REPO, TINY, TORCHRUN, TRAIN, check, launch, run_dirs, sigterm_when
from ids_and_noise import IdsAndNoise
from ddp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_step_checkpoint
from ddp.env import DistEnv
from ddp.loaders import build_train_loader, iterate_from, start_epoch
from models.resnet import build_resnet18
from models.small_cnn import SmallCNN

# gloo worker restarts need a store that isn't shared with the agent (stale keys otherwise, pytorch#135712).
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# Randomness everywhere a resume could get it wrong: dropout (global RNG, per rank), random
# augmentation in 2 DataLoader workers, and a shuffled sampler. 2 ranks x 8 batches x 2 epochs = 16 steps.
DATA = [*TINY, "model.dropout=0.3", "data.augment=true"]
EXACT = ["strategy=ddp", *DATA, "data.num_workers=2", "trainer.max_epochs=2", "trainer.log_every_n_steps=1",
         "checkpoint.every_n_steps=5"]
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


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def the_run_dir(cwd: Path) -> Path:
    dirs = run_dirs(cwd)
    assert len(dirs) == 1, dirs
    return dirs[0]


def rank_log(run_dir: Path, rank: int) -> str:
    return (run_dir / f"train_rank{rank}.log").read_text()


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: (run dir, final last.pt)."""
    cwd = tmp_path_factory.mktemp("reference")
    result = torchrun(EXACT, cwd)
    check(result)
    run_dir = the_run_dir(cwd)
    checkpoint = last_checkpoint(run_dir)
    assert checkpoint["global_step"] == 16 and checkpoint["epoch"] == 2
    return run_dir, checkpoint


# 1 ---------------------------------------------------------------------------------------------

def test_same_config_twice_is_bit_identical(reference, tmp_path):
    """Determinism is what makes "bit-identical after resume" a meaningful promise."""
    check(torchrun(EXACT, tmp_path))
    assert_bit_identical(last_checkpoint(the_run_dir(tmp_path)), reference[1])


# 2 ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """SIGKILL on rank 1 at step 7 (after the step-5 checkpoint), one restart allowed: (run dir, result)."""
    cwd = tmp_path_factory.mktemp("killed")
    result = torchrun([*EXACT, "fault.kill_rank=1", "fault.at_step=7"], cwd, max_restarts=1)
    check(result)
    return the_run_dir(cwd), result  # the run dir survived the restart: one dir, not one per attempt


def test_killed_rank_is_restarted_and_ends_bit_identical(reference, killed_and_resumed):
    """torchrun restarts both workers once, they resume from step 5 in the same run dir, and the
    run ends exactly where the uninterrupted one does."""
    run_dir, result = killed_and_resumed
    assert_bit_identical(last_checkpoint(run_dir), reference[1])

    logs = [rank_log(run_dir, rank) for rank in (0, 1)]
    assert logs[1].count("fault.kill_rank=1: killing this rank at step 7") == 1, logs[1]
    for text in logs:  # each rank's log is appended across the two attempts
        assert text.count("process group up") == 2, text
        resumed = re.findall(r"resumed from (\S+) at epoch 0, batch 5, step 5", text)
        assert resumed == [str(run_dir / "checkpoints" / "last.pt")], text
        assert text.count("resumed from") == 1, text
    assert result.stdout.count("resumed from") == 1, output(result)  # console: rank 0 only


def test_tensorboard_has_every_step_once_after_kill_and_resume(reference, killed_and_resumed):
    """The first attempt logged steps past the checkpoint; the resumed one purges them, so a
    reader sees each train/loss step exactly once, with the same values as the reference."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = killed_and_resumed
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


# 3 ---------------------------------------------------------------------------------------------

def test_exhausted_restart_budget_fails_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1 dies at step 7 on every attempt; after the one allowed restart torchrun gives up.
    (No DataLoader workers here: a killed rank's orphaned workers keep its sockets open until their
    parent-watchdog notices, up to 5 s per attempt, which only slows this test down.)"""
    args = [arg for arg in EXACT if not arg.startswith("data.num_workers=")] + ["data.num_workers=0"]
    result = torchrun([*args, "fault.kill_rank=1", "fault.at_step=7", "fault.every_attempt=true"], tmp_path,
                      max_restarts=1, timeout=NO_HANG_S)
    assert result.returncode != 0, output(result)
    run_dir = the_run_dir(tmp_path)
    assert rank_log(run_dir, 1).count("killing this rank at step 7") == 2  # both attempts died
    directory = run_dir / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt"]
    for name in ("last.pt", "step-00000005.pt"):
        checkpoint = torch.load(directory / name, weights_only=True)
        assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (0, 5, 5)
        SmallCNN(num_classes=10, in_channels=3, channels=[8, 16], dropout=0.3).load_state_dict(checkpoint["model"], strict=True)


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
        from ddp.checkpoint import save_step_checkpoint
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
            from ddp.checkpoint import save_step_checkpoint
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


# 5 ---------------------------------------------------------------------------------------------

def test_corrupt_last_checkpoint_falls_back_to_an_older_one(reference, tmp_path):
    pinned = "hydra.run.dir=outputs/run"
    # keep_best=0: the validation at step 8 would add a step-8 checkpoint (and best-8), another fallback
    result = torchrun([*EXACT, pinned, "checkpoint.keep_best=0", "fault.kill_rank=1", "fault.at_step=12"], tmp_path, max_restarts=0)
    assert result.returncode != 0, output(result)
    directory = tmp_path / "outputs" / "run" / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.pt", "step-00000005.pt", "step-00000010.pt"]
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
    assert_bit_identical(last_checkpoint(tmp_path / "outputs" / "run"), reference[1])


# 6 ---------------------------------------------------------------------------------------------

def test_raising_rank_fails_the_job_fast_and_torchrun_names_it(tmp_path):
    result = torchrun([*EXACT, "fault.raise_rank=1", "fault.at_step=3"], tmp_path, timeout=NO_HANG_S)
    assert result.returncode != 0, output(result)
    assert "Root Cause" in result.stderr, output(result)
    root_cause = result.stderr.split("Root Cause", 1)[1].split("=" * 20, 1)[0]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), root_cause
    assert "RuntimeError: injected fault: fault.raise_rank=1 at step 3" in root_cause, root_cause


# 7 ---------------------------------------------------------------------------------------------

def test_stalled_rank_fails_the_job_after_the_process_group_timeout(tmp_path):
    result = torchrun([*EXACT, "fault.stall_rank=1", "fault.at_step=3", "strategy.timeout_s=5"], tmp_path, timeout=NO_HANG_S)
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


def test_checkpoint_with_pickled_code_is_refused_and_never_run(tmp_path):
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

    result = launch([*SINGLE, f"resume={evil}"], tmp_path, timeout=120)
    assert result.returncode != 0, output(result)
    (line,) = error_lines(result)
    assert "refused" in line and str(evil) in line, line
    assert not marker.exists()


# 9 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [1, 4, 6])
def test_mid_epoch_resume_sees_exactly_the_remaining_samples(start):
    """2 workers, rank 1 of 2: 25 samples in 7 batches. Resuming at batch `start` on a fresh loader
    yields batch indices start.. with the same ids and the same random draws as the full pass."""
    env = DistEnv(rank=1, world_size=2, local_world_size=2, launcher="torchrun")
    data_cfg = SimpleNamespace(batch_size=4, num_workers=2)
    seed, epoch = 0, 1

    def fresh_loader():
        loader = build_train_loader(IdsAndNoise(), data_cfg, env, seed, pin_memory=False)
        start_epoch(loader, epoch, seed, env.rank)
        return loader

    full = list(fresh_loader())
    assert len(full) == 7
    expected = DistributedSampler(range(50), num_replicas=2, rank=1, shuffle=True, seed=seed)
    expected.set_epoch(epoch)
    assert torch.cat([ids for ids, _ in full]).tolist() == list(expected)

    resumed = list(iterate_from(fresh_loader(), start))
    assert [index for index, _ in resumed] == list(range(start, 7))
    ids = torch.cat([ids for ids, _ in full[:start]] + [ids for _, (ids, _) in resumed])
    assert ids.tolist() == list(expected)
    for (ids, noise), (_, (resumed_ids, resumed_noise)) in zip(full[start:], resumed):
        assert torch.equal(resumed_ids, ids) and torch.equal(resumed_noise, noise)


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
def test_resume_into_a_different_model_is_one_error_line(reference, tmp_path, model_args, model):
    source = reference[0] / "checkpoints" / "last.pt"
    args = [arg for arg in SINGLE if not arg.startswith("model.")]
    result = launch([*args, *model_args, f"resume={source}"], tmp_path, timeout=120)
    assert result.returncode == 1, output(result)
    assert len(error_lines(result)) == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    line = error_lines(result)[0]
    assert str(source) in line, line
    listed = re.search(r"missing keys (\[.*?\]), unexpected keys (\[.*?\]), different shapes (\[.*?\])$", line)
    missing, unexpected, reshaped = (ast.literal_eval(group) for group in listed.groups())
    torch_missing, torch_unexpected, torch_reshaped = _torch_mismatch(model(), reference[1]["model"])
    assert torch_missing or torch_unexpected or torch_reshaped
    assert (unexpected, reshaped) == (torch_unexpected, torch_reshaped)
    # torch fills in a missing BatchNorm num_batches_tracked by itself; a resume names it too
    assert set(torch_missing) <= set(missing), line
    assert all(key.endswith(".num_batches_tracked") for key in set(missing) - set(torch_missing)), line
    assert not list(tmp_path.rglob("events.out.tfevents*"))


# 11 --------------------------------------------------------------------------------------------

def test_sigterm_to_torchrun_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    """Preemption: SIGTERM to torchrun reaches the workers, which finish the step, save and stop;
    a relaunch with resume=auto in the same run dir carries on from that step. With 2 DataLoader
    workers per rank, which must not die of the signal first.
    On a loaded machine the first step can come late after the signal: the ranks may wait up to 45 s for
    it (trainer.stop_deadline_s), and torchrun 55 s for them (--shutdown-timeout, 30 s by default), which
    bound only a failure's wait."""
    num_workers = 2
    pinned = "hydra.run.dir=outputs/run"
    long_run = ["strategy=ddp", *DATA, f"data.num_workers={num_workers}", "trainer.max_epochs=100000",
                "checkpoint.every_n_steps=100000", "trainer.stop_deadline_s=45", pinned]
    run_dir = tmp_path / "outputs" / "run"
    log_file = run_dir / "train_rank0.log"
    command = [str(TORCHRUN), "--nproc_per_node=2", "--shutdown-timeout=55", str(TRAIN), *long_run]
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, cwd=tmp_path, env=_clean_env(), stdout=stdout, stderr=stderr,
                                   start_new_session=True)

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
    assert saved > 0
    for rank in (0, 1):
        assert f"stopped by SIGTERM at step {saved}" in rank_log(run_dir, rank), rank_log(run_dir, rank)

    result = torchrun(["strategy=ddp", *DATA, f"data.num_workers={num_workers}", "trainer.max_epochs=100000",
                       f"trainer.max_steps={saved + 3}", "checkpoint.every_n_steps=100000", pinned, "resume=auto"], tmp_path)
    check(result)
    assert re.search(rf"resumed from \S+ at epoch {checkpoint['epoch']}, batch {checkpoint['batch_in_epoch']}, step {saved}\b",
                     result.stdout), output(result)
    assert last_checkpoint(run_dir)["global_step"] == saved + 3


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

def test_resume_from_a_missing_path_starts_nothing(tmp_path):
    missing = tmp_path / "nowhere" / "last.pt"
    result = launch([*SINGLE, f"resume={missing}"], tmp_path, timeout=120)
    assert result.returncode == 1, output(result)
    (line,) = error_lines(result)
    assert str(missing) in line and "not found" in line, line
    assert not list(tmp_path.rglob("events.out.tfevents*"))
    assert not list(tmp_path.rglob("*.pt"))


# 13 --------------------------------------------------------------------------------------------

# One process, 16 steps per epoch (128 samples, batch 8), dropout, augmentation in 2 workers.
EXTEND = ["strategy=single", *DATA, "data.num_workers=2", "trainer.max_epochs=3"]


@pytest.fixture(scope="module")
def stopped_at_step_5(tmp_path_factory):
    """A run cut short by trainer.max_steps=5, a third of the way into its first epoch: its run dir."""
    cwd = tmp_path_factory.mktemp("max_steps_5")
    check(launch([*EXTEND, "trainer.max_steps=5"], cwd))
    return the_run_dir(cwd)


def test_a_max_steps_stop_mid_epoch_records_where_it_stopped(stopped_at_step_5):
    checkpoint = last_checkpoint(stopped_at_step_5)
    assert (checkpoint["epoch"], checkpoint["batch_in_epoch"], checkpoint["global_step"]) == (0, 5, 5)
    results = json.loads((stopped_at_step_5 / "results.json").read_text())
    assert (results["steps"], results["epochs"]) == (5, 0)  # no epoch completed
    assert results["epoch_progress"] == 5 / 16


@pytest.mark.parametrize("steps", [10, 20], ids=["within_the_epoch", "across_an_epoch_boundary"])
def test_extending_a_max_steps_run_is_bit_identical_to_running_that_long(stopped_at_step_5, tmp_path, steps):
    """Train 5 steps, look, then resume the run dir with a larger max_steps: the same as `steps` straight."""
    extended = tmp_path / "extended" / "run"
    shutil.copytree(stopped_at_step_5, extended)
    result = launch([*EXTEND, f"trainer.max_steps={steps}", f"resume={extended}"], tmp_path / "extended")
    check(result)
    assert "at epoch 0, batch 5, step 5" in result.stdout, output(result)
    straight = tmp_path / "straight"
    straight.mkdir()
    check(launch([*EXTEND, f"trainer.max_steps={steps}"], straight))
    assert_bit_identical(last_checkpoint(extended), last_checkpoint(the_run_dir(straight)))


def test_extending_a_two_rank_max_steps_run_is_bit_identical(reference, tmp_path):
    """2 ranks: stop at step 3 of 8, then extend to the full 2 epochs: the uninterrupted reference."""
    pinned = "hydra.run.dir=outputs/run"
    check(torchrun([*EXACT, "trainer.max_steps=3", pinned], tmp_path))
    assert last_checkpoint(tmp_path / "outputs" / "run")["batch_in_epoch"] == 3
    check(torchrun([*EXACT, pinned, "resume=outputs/run"], tmp_path))
    assert_bit_identical(last_checkpoint(tmp_path / "outputs" / "run"), reference[1])


def test_extending_a_max_steps_run_is_bit_identical_with_augmentation_in_the_main_process(tmp_path):
    """Without loader workers the augmentation draws from the global RNG as each batch loads: the
    run stopped by max_steps must load no batch past its last update, or its checkpoint holds the RNG
    after a draw that the run never trained on, and the extended run draws differently."""
    args = [arg for arg in EXTEND if not arg.startswith("data.num_workers=")] + ["data.num_workers=0"]
    extended = tmp_path / "extended"
    extended.mkdir()
    check(launch([*args, "trainer.max_steps=5", "hydra.run.dir=outputs/run"], extended))
    result = launch([*args, "trainer.max_steps=10", "hydra.run.dir=outputs/run", "resume=outputs/run"], extended)
    check(result)
    assert "at epoch 0, batch 5, step 5" in result.stdout, output(result)
    straight = tmp_path / "straight"
    straight.mkdir()
    check(launch([*args, "trainer.max_steps=10"], straight))
    assert_bit_identical(last_checkpoint(extended / "outputs" / "run"), last_checkpoint(the_run_dir(straight)))
