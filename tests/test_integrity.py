"""Checkpoints verified before they are trusted (ddp/checkpoints/verify.py): a bit flipped in a checkpoint file's
tensor data is caught wherever it lands; resume=auto and resume=<run dir> skip such a file for the newest one that
verifies and end bit-identical to the uninterrupted run; a file named explicitly (resume=, mode=eval's resume=,
model.weights_path, a distillation teacher) is one line that calls it corrupt, before anything starts; the verify
command names each checkpoint of a run dir good, corrupt or unverified. (A sharded checkpoint's: tests/test_fsdp.py.)"""

import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import (EXACT_DDP, EXACT_SINGLE, EXACT_SINGLE_STEPS, REPO, check, config_error_in_this_process,
                      last_checkpoint, launch, run_in_this_process, shared_run)
from ddp.checkpoints.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint, save_checkpoint
from test_fault_tolerance import assert_bit_identical

FLIPS = 8  # bits flipped, one at a time, at random offsets of the tensor data
SEED = 20261206


def tensor_data_offsets(path: Path) -> list[int]:
    """The byte offsets of every tensor's data in a torch.save file (its zip records under data/)."""
    offsets = []
    with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
        for record in archive.infolist():
            if "/data/" not in record.filename or record.file_size == 0:
                continue
            file.seek(record.header_offset + 26)
            name_length, extra_length = int.from_bytes(file.read(2), "little"), int.from_bytes(file.read(2), "little")
            start = record.header_offset + 30 + name_length + extra_length
            offsets += range(start, start + record.file_size)
    return offsets


def flip_bit(path: Path, offset: int, bit: int) -> None:
    """One bit of `path` flipped in place, as a disk or a copy over the network might."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ (1 << bit)]))


@pytest.fixture(scope="module")
def stopped_at_step_10(tmp_path_factory) -> Path:
    """EXACT_SINGLE cut short by trainer.max_steps=10 (checkpoints at steps 10 and, from a first part stopped at 5,
    step 5): its run dir, made once by train.run in a test process; tests copy it."""
    def two_parts(cwd: Path) -> None:
        run_dir = cwd / "run"
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process([*EXACT_SINGLE, "trainer.max_steps=5"], run_dir)
            run_in_this_process([*EXACT_SINGLE, "trainer.max_steps=10", f"resume={run_dir}"], run_dir)
    return shared_run("integrity_stopped_at_step_10", two_parts, tmp_path_factory)[0] / "run"


def test_a_bit_flipped_anywhere_in_a_checkpoints_tensor_data_is_caught(stopped_at_step_10, tmp_path):
    """At FLIPS random offsets of the tensor data (a different bit each time), the checkpoint is refused as corrupt,
    naming the file and the record; unflipped, it loads. torch.load alone loads every one of them."""
    original = stopped_at_step_10 / "checkpoints" / "step-00000010.pt"
    offsets = tensor_data_offsets(original)
    rng = random.Random(SEED)
    for offset in rng.sample(offsets, FLIPS):
        flipped = tmp_path / "flipped.pt"
        shutil.copyfile(original, flipped)
        flip_bit(flipped, offset, rng.randrange(8))
        torch.load(flipped, weights_only=True)  # what torch itself does with it: loads it
        with pytest.raises(CheckpointError, match=rf"^{flipped}: corrupt, record \S+/data/\d+ fails its CRC-32 check"):
            load_checkpoint(flipped)
    assert load_checkpoint(original)["global_step"] == 10


def test_a_checkpoint_saved_without_crcs_loads_unverified_and_says_so(tmp_path, caplog):
    """torch.save can write its records without CRC-32s (CRC 0): such a file has nothing to check against, so it
    loads, and the log says it is unverified; a flipped bit in it can't be seen."""
    from torch.utils.serialization import config

    path = tmp_path / "no-crc.pt"
    config.save.compute_crc32 = False
    try:
        save_checkpoint({"model": {"weight": torch.arange(1000.0)}}, path)
    finally:
        config.save.compute_crc32 = True
    flip_bit(path, tensor_data_offsets(path)[100], 3)
    with caplog.at_level("INFO"):
        assert load_checkpoint(path)["model"]["weight"][25] != 25.0
    assert f"{path} carries no digest, so it loads unverified" in caplog.text


def test_resume_of_a_run_dir_whose_newest_checkpoint_has_a_flipped_bit_falls_back_and_ends_bit_identical(
        stopped_at_step_10, exact_single_reference, tmp_path, monkeypatch, caplog):
    """last.pt (another name of step-00000010.pt) gets a flipped bit: resume=<run dir> names each as corrupt in one
    line, resumes from step 5 and trains to the end bit-identical to the uninterrupted run."""
    run_dir = shutil.copytree(stopped_at_step_10, tmp_path / "run")  # copies: last.pt is no longer step-10's other name
    last = run_dir / "checkpoints" / "last.pt"
    offset = random.Random(SEED).choice(tensor_data_offsets(last))
    for path in (last, run_dir / "checkpoints" / "step-00000010.pt"):
        flip_bit(path, offset, 5)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"):
        run_in_this_process([*EXACT_SINGLE, f"trainer.max_steps={EXACT_SINGLE_STEPS}", f"resume={run_dir}"], run_dir)
    skipped = [line for line in caplog.text.splitlines() if "skipping checkpoint" in line]
    assert [line.split("skipping checkpoint ", 1)[1].split(":")[0] for line in skipped] == [
        str(last), str(run_dir / "checkpoints" / "step-00000010.pt")], caplog.text
    assert all("corrupt, record" in line and "fails its CRC-32 check" in line for line in skipped), skipped
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000005.pt'} at epoch 0, batch 5, step 5" in caplog.text
    assert_bit_identical(last_checkpoint(run_dir), exact_single_reference[1])


def test_resume_auto_on_two_ranks_skips_a_flipped_checkpoint_together_and_ends_bit_identical(exact_ddp_reference, tmp_path):
    """The 2-rank reference's checkpoints up to step 15, last.pt pointing at it, with a bit flipped: both ranks skip
    it, resume from step 10 and end bit-identical to the uninterrupted run."""
    reference_dir, reference = exact_ddp_reference
    directory = tmp_path / "outputs" / "run" / "checkpoints"
    directory.mkdir(parents=True)
    for step in (10, 15):
        shutil.copyfile(reference_dir / "checkpoints" / f"step-{step:08d}.pt", directory / f"step-{step:08d}.pt")
    (directory / "last.pt").hardlink_to(directory / "step-00000015.pt")
    flip_bit(directory / "last.pt", random.Random(SEED).choice(tensor_data_offsets(directory / "last.pt")), 0)
    result = launch([*EXACT_DDP, "hydra.run.dir=outputs/run", "resume=auto"], tmp_path, nproc=2)
    check(result)
    for rank in (0, 1):
        log = (directory.parent / f"train_rank{rank}.log").read_text()
        assert f"resumed from {directory / 'step-00000010.pt'} at epoch 1, batch 2, step 10" in log, log
        assert f"skipping checkpoint {directory / 'last.pt'}: corrupt" in log, log
    assert_bit_identical(last_checkpoint(directory.parent), reference)


@pytest.fixture(scope="module")
def corrupt_checkpoint(stopped_at_step_10, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corrupt") / "step-00000010.pt"
    shutil.copyfile(stopped_at_step_10 / "checkpoints" / "step-00000010.pt", path)
    flip_bit(path, random.Random(SEED).choice(tensor_data_offsets(path)), 7)
    return path


@pytest.mark.parametrize("overrides", [
    ["resume={path}"],
    ["mode=eval", "resume={path}"],
    ["model.weights_path={path}"],
    ["task=distillation", "task.teacher={path}"],
], ids=["resume", "eval", "weights_path", "teacher"])
def test_a_corrupt_checkpoint_named_explicitly_is_one_line_before_anything_starts(corrupt_checkpoint, overrides, tmp_path,
                                                                                     monkeypatch):
    """One line that names the file and calls it corrupt (not a traceback, not a divergence): no run dir, process
    group, event file or checkpoint (config_error_in_this_process checks them)."""
    monkeypatch.chdir(tmp_path)
    args = [override.format(path=corrupt_checkpoint) for override in overrides]
    line = config_error_in_this_process([*EXACT_SINGLE, *args], tmp_path / "run")
    assert f"{corrupt_checkpoint}: corrupt, record" in line and "fails its CRC-32 check" in line, line


def test_a_corrupt_resume_file_on_the_command_line_is_one_error_line_and_leaves_no_run_dir(corrupt_checkpoint, tmp_path):
    result = launch([*EXACT_SINGLE, f"resume={corrupt_checkpoint}"], tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: resume=") and f"{corrupt_checkpoint}: corrupt" in lines[0], result.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())


# Counts the opens of one file and the processes started with it as an argument (Python's audit events, which every
# open and every subprocess raise: the reads, and the checkers that verify it) while running train.py's command line,
# or one load_checkpoint of the file, and writes both counts at exit.
COUNT_OPENS = """
import atexit, os, runpy, sys
from pathlib import Path
target, out, what = sys.argv[1], sys.argv[2], sys.argv[3]
seen = {"open": 0, "subprocess.Popen": 0}

def count(event, args):
    if event == "open" and isinstance(args[0], str) and os.path.abspath(args[0]) == target:
        seen[event] += 1
    elif event == "subprocess.Popen" and target in map(str, args[1]):
        seen[event] += 1

sys.addaudithook(count)
atexit.register(lambda: Path(out).write_text(f"{seen['open']} {seen['subprocess.Popen']}"))
if what == "load":
    from ddp.checkpoints.checkpoint import load_checkpoint
    load_checkpoint(Path(target))
else:
    sys.argv = ["train.py", *sys.argv[4:]]
    runpy.run_path("train.py", run_name="__main__")
"""


def test_mode_eval_reads_its_checkpoint_once(stopped_at_step_10, tmp_path):
    """mode=eval takes the checkpoint's task and then its weights: from one read of the file and one verification
    (its checker process), as one load_checkpoint makes, not two."""
    checkpoint = str(stopped_at_step_10 / "checkpoints" / "step-00000010.pt")

    def reads_and_checks(*args: str) -> list[int]:
        result = subprocess.run([sys.executable, "-c", COUNT_OPENS, checkpoint, str(tmp_path / "counts"), *args], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [int(count) for count in (tmp_path / "counts").read_text().split()]

    assert reads_and_checks("load") == [1, 1]  # torch.load's open, and the checker beside it
    assert reads_and_checks("eval", *EXACT_SINGLE, "mode=eval", f"resume={checkpoint}", f"hydra.run.dir={tmp_path}/eval") == [1, 1]


def test_the_verify_command_names_each_checkpoint_and_fails_on_a_corrupt_one(stopped_at_step_10, tmp_path):
    """`python -m ddp.checkpoints.verify <run dir>`: a line per checkpoint (good, corrupt or unverified), exit 1 when
    one is corrupt, 0 when none is; a checkpoint named alone is verified alone."""
    run_dir = shutil.copytree(stopped_at_step_10, tmp_path / "run")
    verify = [sys.executable, "-m", "ddp.checkpoints.verify"]
    good = subprocess.run([*verify, str(run_dir)], cwd=REPO, capture_output=True, text=True)
    assert good.returncode == 0, good.stdout + good.stderr
    checkpoints = sorted((run_dir / "checkpoints").glob("*.pt"))  # last, best, best-10, step-5, step-10
    assert good.stdout.splitlines() == [f"good  {path}" for path in checkpoints] and len(checkpoints) >= 3
    step_5 = run_dir / "checkpoints" / "step-00000005.pt"
    flip_bit(step_5, tensor_data_offsets(step_5)[0], 1)
    bad = subprocess.run([*verify, str(run_dir)], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1
    assert [line.split("  ")[0] for line in bad.stdout.splitlines()] == ["corrupt" if path == step_5 else "good" for path in checkpoints]
    assert f"corrupt  {step_5}: record " in bad.stdout and "fails its CRC-32 check" in bad.stdout, bad.stdout
    alone = subprocess.run([*verify, str(run_dir / "checkpoints" / "last.pt")], cwd=REPO, capture_output=True, text=True)
    assert (alone.returncode, alone.stdout) == (0, f"good  {run_dir / 'checkpoints' / 'last.pt'}\n")
