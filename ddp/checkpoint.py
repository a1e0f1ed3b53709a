"""Checkpoints written atomically by rank 0, loaded without running pickled code."""

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write to a temp file in the same dir, fsync, then rename over `path`.

    A save that dies (full disk, kill, an error while pickling) leaves the previous file intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """weights_only=True: tensors and plain containers only; a pickled object is refused, not run."""
    return torch.load(path, map_location=map_location, weights_only=True)
