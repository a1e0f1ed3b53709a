"""Sharded checkpoints (strategy=fsdp and hsdp): `checkpoints/step-<N>/`, written by every rank, atomically.

Each is a torch.distributed.checkpoint (DCP) dir: every rank writes its shards of the model and the
optimizer state (`get_state_dict`), into `.step-<N>.tmp/`. Rank 0 then adds `state.pt`, everything
else a resume needs (position, schedule, the run's config, every rank's RNG state under
its rank, the optimizer's param_groups), written as ddp/checkpoints/checkpoint.py writes a checkpoint file, and the
manifest `digests.json` (each file's size and CRC-32; each rank hashes the shards it wrote), then renames the dir to
`step-<N>`: a kill mid-save leaves no `step-<N>` for resume=auto to pick. With checkpoint.async_save, the shards are
copied to memory and all of this after the copy runs in a background thread, on a process group of the save's own.

DCP reshards on load (`set_state_dict`), so a checkpoint resumes at any world size, and its model
reads back whole in one process (`full_model_state`: mode=eval, the export to one file). The DCP part
holds tensors only; `state.pt` loads with weights_only=True. DCP's own `.metadata` is a pickle, which
torch reads with an unrestricted pickle.load: ddp/checkpoints/checkpoint.py unpickles it first with only the
globals DCP writes there, and refuses an index that names any other or that points at a pickled object.
"""

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ddp.checkpoints.checkpoint import (SHARDED_STATE, CheckpointError, DiskFull, checkpoint_dir, disk_full, fsync_dir,
                                        no_space_left, save_checkpoint, verify_sharded_checkpoint)
from ddp.checkpoints.verify import digests_of, write_digests
from ddp.distributed.process_group import broadcast_buffers_from_rank_zero


def save_sharded_checkpoint(model: nn.Module, optimizer, state: dict[str, Any], run_dir: Path, step: int,
                            keep_last: int, group: dist.ProcessGroup | None = None) -> Callable[[], Path]:
    """A collective: every rank writes its shards; rank 0 writes `state` and publishes `step-<step>/`,
    then keeps only the newest `keep_last` sharded checkpoints. The buffers saved are rank 0's (its
    BatchNorm statistics, as a checkpoint file holds), whatever each rank's were. Returns `publish`, which
    completes the save and returns its dir; every rank calls it.

    group None: DCP writes the shards here, and `publish` runs on the default process group. A `group`
    of the save's own (checkpoint.async_save): DCP copies the shards to memory here and writes them in a
    thread, and `publish` (in the caller's background thread) waits for them and uses only `group`, so
    the training's collectives never meet the save's. A full disk, at any rank's shards or at rank 0's
    state, makes `publish` raise DiskFull (rank 0's line names the dir and the free space once the
    unpublished temp dir is removed); the checkpoints published before are intact."""
    directory = checkpoint_dir(run_dir)
    final, tmp = directory / f"step-{step:08d}", directory / f".step-{step:08d}.tmp"
    is_main = dist.get_rank() == 0
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".step-*.tmp"):  # left by a killed save
            shutil.rmtree(stale)
    dist.barrier()  # nobody writes into the temp dir before it is clean
    # FSDP doesn't shard buffers, and DCP writes one rank's copy of each, not necessarily rank 0's
    broadcast_buffers_from_rank_zero(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    shards = {"model": model_state, "optimizer": optimizer_state["state"]}
    if group is None:
        try:
            dcp.save(shards, checkpoint_id=tmp)
            written = None
        except CheckpointException as error:  # every rank gets every rank's failure, once all are done writing
            written = error
    else:
        written = dcp.async_save(shards, checkpoint_id=tmp, process_group=group)  # copied to memory before it returns
    state = {**state, "sharded": True, "optimizer_param_groups": optimizer_state["param_groups"]} if is_main else {}

    def publish() -> Path:
        try:
            if isinstance(written, BaseException):
                raise written
            if written is not None:
                written.result()
        except CheckpointException as error:
            full = any(no_space_left(failure, directory) for failure, _ in error.failures.values())
            written_mb = _size_mb(tmp)
            dist.barrier(group=group)  # every rank has looked at the free space and the temp dir before rank 0 removes it
            if not full:
                raise
            raise _sharded_save_failed(final, tmp, written_mb, is_main) from None
        # each rank hashes the shards it wrote (DCP names them __<rank>_<n>.distcp), while they are in its page cache
        ranks_digests = [None] * dist.get_world_size() if is_main else None
        dist.gather_object(digests_of(sorted(tmp.glob(f"__{dist.get_rank()}_*.distcp"))), ranks_digests, dst=0, group=group)
        if is_main:
            _publish(state, ranks_digests, directory, final, tmp, keep_last)
        return final

    return publish


def _publish(state: dict[str, Any], ranks_digests: list[dict], directory: Path, final: Path, tmp: Path, keep_last: int) -> None:
    """Rank 0: state.pt and the manifest into the temp dir, then the rename that publishes it, then keep_last's pruning."""
    try:
        save_checkpoint(state, tmp / SHARDED_STATE)
        digests = {name: digest for rank_digests in ranks_digests for name, digest in rank_digests.items()}
        unhashed = [path for path in tmp.iterdir() if path.name not in digests]  # the index, state.pt, any other
        write_digests(tmp, digests | digests_of(unhashed))
    except DiskFull:
        raise _sharded_save_failed(final, tmp, _size_mb(tmp), True) from None
    except OSError as error:
        if not no_space_left(error, directory):
            raise
        raise _sharded_save_failed(final, tmp, _size_mb(tmp), True) from None
    if final.exists():  # saved before at this step (a resumed run): a dir is not replaced by a rename
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(directory)
    for old in sorted(p for p in directory.glob("step-*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)


def _sharded_save_failed(final: Path, tmp: Path, written_mb: float, is_main: bool) -> DiskFull:
    """A sharded save out of space: rank 0 removes the temp dir (every rank's shards), which no resume would pick
    but which holds the space; the line names the dir it would have published."""
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    return disk_full(final, written_mb)


def _size_mb(directory: Path) -> float:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) / 2**20


def load_sharded_state(path: Path, model: nn.Module, optimizer, param_groups: list[dict]) -> None:
    """The checkpoint's model and optimizer state into the sharded `model` and its `optimizer`, at any
    world size (DCP reads the parts of the saved shards that this rank's shards cover)."""
    # get_state_dict gives the optimizer a state to load into (a zero step, if it has none yet)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict={"state": optimizer_state["state"], "param_groups": param_groups})


def full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The sharded checkpoint's model as one plain state_dict of full tensors, read in this process
    alone (no process group, any world size and strategy): DCP fills tensors of the saved full shapes
    from every rank's shards. Buffers are rank 0's (save_sharded_checkpoint saves those)."""
    verify_sharded_checkpoint(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
        state = {key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
                 for key, entry in metadata.state_dict_metadata.items()
                 if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
        with warnings.catch_warnings():  # no_dist=True is the intent, which DCP warns it assumes
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: unreadable sharded checkpoint ({reason})") from None
    return state
