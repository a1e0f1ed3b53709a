"""Checkpoints: written atomically by rank 0, found newest-first, loaded without running pickled code."""

import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

LAST = "last.pt"


class CheckpointError(Exception):
    """A checkpoint that can't or mustn't be loaded."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write to a temp file in the same dir, fsync, then rename over `path`.

    A save that dies (full disk, kill, an error while pickling) leaves the previous file intact;
    a temp file left by a killed save is removed by the next save.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException as error:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(error, RuntimeError):  # torch hides the errno ("unexpected pos ..." on a full disk)
            free_mb = shutil.disk_usage(path.parent).free / 2**20
            raise RuntimeError(f"saving {path} failed, the previous checkpoint is intact ({free_mb:.0f} MB free): {error}") from error
        raise
    _fsync_dir(path.parent)


def save_step_checkpoint(state: dict[str, Any], run_dir: Path, step: int, keep_last: int) -> Path:
    """Save `step-<step>.pt`, point `last.pt` at it, and keep only the newest `keep_last` step files."""
    directory = checkpoint_dir(run_dir)
    path = directory / f"step-{step:08d}.pt"
    save_checkpoint(state, path)
    tmp = directory / f".{LAST}.link.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)  # same bytes, no second write
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, directory / LAST)
    _fsync_dir(directory)
    for old in sorted(directory.glob("step-*.pt"))[:-keep_last]:
        old.unlink()
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """weights_only=True: tensors and plain containers only. A pickled object is refused, never run."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0]
        raise CheckpointError(f"{path}: refused, it holds pickled objects that weights_only loading won't run ({reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({str(error).strip().splitlines()[0]})") from None


def load_latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `run_dir` that loads; bad ones are logged and skipped."""
    directory = checkpoint_dir(run_dir)
    candidates = [directory / LAST, *sorted(directory.glob("step-*.pt"), reverse=True)]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            return path, load_checkpoint(path)
        except CheckpointError as error:
            log.warning("skipping checkpoint %s", error)
    return None
