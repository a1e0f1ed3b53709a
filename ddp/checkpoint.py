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
BEST = "best.pt"


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
    _link(path, directory / LAST)
    _fsync_dir(directory)
    for old in sorted(directory.glob("step-*.pt"))[:-keep_last]:
        old.unlink()
    return path


def keep_best_checkpoints(run_dir: Path, kept_steps: list[int], saved: tuple[int, Path] | None = None) -> None:
    """Keep `saved` (the step and path of the checkpoint just saved) as `best-<step>.pt` if its step is
    among `kept_steps` (best first), delete every other `best-*.pt`, and point `best.pt` at the best.
    The best files are other names of step files (hard links): keep_last's pruning of step-*.pt leaves them."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():  # a run resumed from another dir's checkpoint file has saved nothing here yet
        return
    if saved is not None and saved[0] in kept_steps:
        _link(saved[1], directory / f"best-{saved[0]:08d}.pt")
    kept = {f"best-{kept:08d}.pt" for kept in kept_steps}
    for old in directory.glob("best-*.pt"):
        if old.name not in kept:
            old.unlink()
    if kept_steps and (directory / f"best-{kept_steps[0]:08d}.pt").is_file():
        _link(directory / f"best-{kept_steps[0]:08d}.pt", directory / BEST)
    _fsync_dir(directory)


def _link(path: Path, name: Path) -> None:
    """`name` becomes another name of `path`, atomically (a copy where hard links fail)."""
    tmp = name.with_name(f".{name.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)  # same bytes, no second write
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, name)


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
