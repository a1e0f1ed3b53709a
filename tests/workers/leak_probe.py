"""A Hydra callback for tests: what each job of an in-process sweep leaves behind. At every job's
start and end it appends one JSON line to `path`: the live nn.Modules and tensors (after a full
garbage collection, so only what is still reachable), this process's DataLoader workers (processes
forked by its children, e.g. the fork server's) and its TensorBoard event writers not closed.

    python train.py -m ... +hydra.callbacks.leak_probe._target_=tests.workers.leak_probe.LeakProbe \
        +hydra.callbacks.leak_probe.path=<file>
"""

import gc
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process on this host."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces
    return parents


def _grandchildren() -> int:
    parents = _parents()
    children = {pid for pid, parent in parents.items() if parent == os.getpid()}
    return sum(parent in children for parent in parents.values())


def _open_event_writers() -> int:
    """TensorBoard event writers not closed: each has a thread of its own until it is."""
    return sum(type(thread).__name__ == "_AsyncWriterThread" for thread in threading.enumerate())


class LeakProbe(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _record(self, config: DictConfig, when: str) -> None:
        gc.collect()
        objects = gc.get_objects()
        with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
            warnings.simplefilter("ignore")
            modules = sum(isinstance(o, torch.nn.Module) for o in objects)
            tensors = sum(isinstance(o, torch.Tensor) for o in objects)
        record = {
            "job": config.hydra.job.num,
            "when": when,
            "modules": modules,
            "tensors": tensors,
            "loader_workers": _grandchildren(),
            "open_event_writers": _open_event_writers(),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._record(config, "start")

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        self._record(config, "end")
