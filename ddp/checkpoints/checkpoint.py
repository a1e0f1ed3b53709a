"""Checkpoints: written atomically by rank 0, found newest-first, verified against their digests and loaded
without running pickled code. strategy=fsdp's are dirs of shards (ddp/checkpoints/sharded_checkpoint.py); their
state.pt is written and read here, and their DCP index (a pickle, which torch's reader unpickles with no
restriction) is checked here first."""

import errno
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp.checkpoints import verify as verify_module
from ddp.checkpoints.verify import VERDICT, Corrupt, verdict_of

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
SHARDED_STATE = "state.pt"  # a sharded checkpoint's rank-0 part: all but the model's and the optimizer's tensors
SHARDED_INDEX = ".metadata"  # DCP's index, written last by its coordinator


class CheckpointError(Exception):
    """A checkpoint that can't or mustn't be loaded."""


class DiskFull(Exception):
    """A save that found no space left on its device. What was saved before is intact: the run can
    continue from it once there is space."""

    continues_once_fixed = True  # the run's failure line adds the command that continues it (ddp/jobs/failures.py)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(state: dict[str, Any], path: Path, before_publish: Callable[[], None] | None = None) -> None:
    """Write to a temp file in the same dir, fsync, then rename over `path` (`before_publish`, a fault aid, runs
    between the two).

    A save that dies (full disk, kill, an error while pickling) leaves the previous file intact;
    a temp file left by a killed save is removed by the next save. A full disk raises DiskFull, one
    line naming the path, the cause and the free space.
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
        if before_publish is not None:
            before_publish()
        os.replace(tmp_name, path)
    except BaseException as error:
        written_mb = os.stat(tmp_name).st_size / 2**20 if os.path.exists(tmp_name) else 0.0
        full = no_space_left(error, path.parent)  # asked before the temp file's removal frees its space
        Path(tmp_name).unlink(missing_ok=True)
        if full:
            raise disk_full(path, written_mb) from None
        if isinstance(error, RuntimeError):  # torch hides the errno ("unexpected pos ..." on a full disk)
            free_mb = shutil.disk_usage(path.parent).free / 2**20
            raise RuntimeError(f"saving {path} failed, the previous checkpoint is intact ({free_mb:.0f} MB free): {error}") from error
        raise
    fsync_dir(path.parent)


def disk_full(path: Path, written_mb: float) -> DiskFull:
    """The one line of a save of `path` (a file, or a sharded checkpoint's dir) that ran out of space after writing
    `written_mb`, whose partial files are removed: the free space it names is what a next save would find."""
    free_mb = shutil.disk_usage(path.parent).free / 2**20
    return DiskFull(f"saving {path} failed: no space left on device ({path.parent} has {free_mb:.1f} MB free, and "
                    f"the save needs more than the {written_mb:.1f} MB it wrote); what was saved before is intact: free some space")


def no_space_left(error: BaseException, directory: Path) -> bool:
    """Whether a failed write ran out of space. torch.save's own writer hides the errno ("[enforce fail
    at inline_container.cc] unexpected pos ..."), so a RuntimeError counts where the device has less
    than 1 MiB left: a write fails on a full disk with only a partial block free."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and shutil.disk_usage(directory).free < 2**20


def save_step_checkpoint(state: dict[str, Any], run_dir: Path, step: int, keep_last: int,
                         before_publish: Callable[[], None] | None = None) -> Path:
    """Save `step-<step>.pt`, point `last.pt` at it, and keep only the newest `keep_last` step files."""
    directory = checkpoint_dir(run_dir)
    path = directory / f"step-{step:08d}.pt"
    save_checkpoint(state, path, before_publish)
    _link(path, directory / LAST)
    fsync_dir(directory)
    for old in sorted(directory.glob("step-*.pt"))[:-keep_last]:
        old.unlink()
    return path


def keep_best_checkpoints(run_dir: Path, kept_steps: list[int], saved: tuple[int, Path] | None = None) -> None:
    """Keep `saved` (the step and path of the checkpoint just saved) as `best-<step>.pt` if its step is
    among `kept_steps` (best first), delete every other `best-*.pt`, and point `best.pt` at the best.
    The best files are other names of step files (hard links): keep_last's pruning of step-*.pt leaves them.
    A sharded checkpoint (a dir) is kept the same way, as `best-<step>/` and `best/` of hard-linked files."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():  # a run resumed from another dir's checkpoint file has saved nothing here yet
        return
    if saved is not None and saved[0] in kept_steps:
        _link(saved[1], directory / f"best-{saved[0]:08d}{saved[1].suffix}")
    kept = {f"best-{kept:08d}" for kept in kept_steps}
    for old in directory.glob("best-*"):
        if old.name.removesuffix(".pt") not in kept:
            _remove(old)
    best = [directory / f"best-{kept_steps[0]:08d}{suffix}" for suffix in (".pt", "")] if kept_steps else []
    for path in best:
        if path.exists():
            _link(path, directory / (BEST if path.suffix else BEST.removesuffix(".pt")))
    fsync_dir(directory)


def _link(path: Path, name: Path) -> None:
    """`name` becomes another name of `path`, atomically (a copy where hard links fail); for a dir, a
    dir of other names of its files."""
    tmp = name.with_name(f".{name.name}.link.tmp")
    _remove(tmp)
    if path.is_dir():
        shutil.copytree(path, tmp, copy_function=_link_file)
        _remove(name)  # a rename doesn't replace a dir that has files
    else:
        _link_file(path, tmp)
    os.replace(tmp, name)


def _link_file(path, name) -> None:
    try:
        os.link(path, name)  # same bytes, no second write
    except OSError:
        shutil.copyfile(path, name)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Verified first (ddp/checkpoints/verify.py): a file or dir whose bytes changed since its save is refused as
    corrupt. weights_only=True: tensors and plain containers only. A pickled object is refused, never run.
    A sharded checkpoint's (a dir's) is its state.pt: the shards load once the model is sharded."""
    if path.is_dir() and (path / SHARDED_STATE).is_file():
        if not is_sharded_checkpoint(path):
            raise CheckpointError(f"{path}: incomplete sharded checkpoint (no {SHARDED_INDEX})")
        check_sharded_index(path)
    elif not path.is_file():
        raise CheckpointError(f"{path}: not found")
    return _load_verified(path, path / SHARDED_STATE if path.is_dir() else path)  # a dir's manifest covers state.pt too


def verify_sharded_checkpoint(path: Path) -> None:
    """A sharded checkpoint's index checked and its files verified, none of them loaded: for a reader of its shards."""
    check_sharded_index(path)
    _load_verified(path, None)


def _load_verified(checked: Path, file: Path | None) -> dict[str, Any] | None:
    """`file` (None: nothing) loaded while a process of its own verifies `checked` (verify.py, stdlib alone: it starts in
    milliseconds, and shares no GIL with torch.load, which holds it while it reads each record), so that the check
    adds little to the load's time where a core is free (make bench's integrity row). Loading an unchecked file is
    safe (weights_only runs no code); what it loaded is returned only once the check passed, and a corrupt file is
    named corrupt even where torch.load failed on it first."""
    checker = subprocess.Popen([sys.executable, "-I", verify_module.__file__, VERDICT, str(checked)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        state = _load_file(file) if file is not None else None
    finally:  # on a failed load too: corrupt is the reason to give
        verdict = verdict_of(checker, checked)
        if isinstance(verdict, Corrupt):
            raise CheckpointError(f"{checked}: corrupt, {verdict}: its bytes changed after it was saved") from None
    if not verdict:
        log.info("%s carries no digest, so it loads unverified (saved with torch's CRCs off, a sharded checkpoint "
                 "saved before digests, or another format)", checked)
    return state


def _load_file(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0]
        raise CheckpointError(f"{path}: refused, it holds pickled objects that weights_only loading won't run ({reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({str(error).strip().splitlines()[0]})") from None


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's index with only the globals DCP writes there: its metadata classes, torch's
    dtypes, sizes and layouts, and paths. Anything else (os.system, say) is refused, never called."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
               ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        from torch.distributed.checkpoint import metadata as dcp_metadata  # DCP is imported where it's used (ddp/distributed/fsdp.py)

        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"{module}.{name}")


def check_sharded_index(path: Path) -> None:
    """Refuse a sharded checkpoint whose index would run code when torch's reader unpickles it, or that
    points at a pickled object (DCP loads those with weights_only=False): ours hold tensors only."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    entries = _index_entries(path)
    objects = [key for key, entry in entries.items() if not isinstance(entry, dcp_metadata.TensorStorageMetadata)]
    if objects:
        raise CheckpointError(f"{path / SHARDED_INDEX}: refused, it stores pickled objects, which loading would run ({', '.join(objects)})")


def sharded_model_shapes(path: Path) -> dict[str, torch.Size]:
    """The model's tensors in a sharded checkpoint (their full, unsharded shapes), read from its DCP index
    as check_sharded_index reads it: a resume compares them with the model before any rank loads a shard."""
    return {key.removeprefix("model."): entry.size for key, entry in _index_entries(path).items()
            if key.startswith("model.") and hasattr(entry, "size")}


def _index_entries(path: Path) -> dict[str, Any]:
    """The DCP index's entries (key to metadata), unpickled with _IndexUnpickler's globals only."""
    index = path / SHARDED_INDEX
    try:
        with open(index, "rb") as file:
            return _IndexUnpickler(file).load().state_dict_metadata
    except _ForbiddenGlobal as error:
        raise CheckpointError(f"{index}: refused, it names {error}, which a DCP index doesn't hold and loading would run") from None
    except (pickle.UnpicklingError, AttributeError, EOFError, OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"{index}: unreadable sharded checkpoint index ({str(error).strip() or type(error).__name__})") from None


def is_sharded_checkpoint(path: Path) -> bool:
    """A published sharded checkpoint (strategy=fsdp's dir): DCP's index and rank 0's state are both there."""
    return (path / SHARDED_INDEX).is_file() and (path / SHARDED_STATE).is_file()


def load_latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `run_dir` that loads (a file, or strategy=fsdp's dir); bad ones are logged and skipped."""
    directory = checkpoint_dir(run_dir)
    steps = sorted(directory.glob("step-*"), key=lambda path: path.name.removesuffix(".pt"), reverse=True)
    candidates = [directory / LAST, *steps]
    for path in candidates:
        if not path.exists():
            continue
        try:
            return path, load_checkpoint(path)
        except CheckpointError as error:
            log.warning("skipping checkpoint %s", error)
    return None
