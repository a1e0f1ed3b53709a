"""Injected faults and a record of the samples trained: testing aids for fault tolerance. Off by
default (`fault.*` = -1, `fault.record_samples_dir` = null, `fault.plan` = null)."""

import json
import logging
import os
import signal
import struct
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def inject_fault(fault_cfg, rank: int, step: int) -> None:
    """At `fault.at_step`, make the chosen rank die, raise or stall; on the first attempt only,
    unless `fault.every_attempt` (to exhaust torchrun's --max-restarts)."""
    if step != fault_cfg.at_step:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not fault_cfg.every_attempt:
        return
    if rank == fault_cfg.kill_rank:
        log.warning("fault.kill_rank=%d: killing this rank at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == fault_cfg.raise_rank:
        raise RuntimeError(f"injected fault: fault.raise_rank={rank} at step {step}")
    if rank == fault_cfg.stall_rank:
        log.warning("fault.stall_rank=%d: stalling at step %d", rank, step)
        while True:
            time.sleep(60)


def save_delay_s(fault_cfg, step: int) -> float:
    """fault.slow_save_s for the background write of fault.slow_save_step's checkpoint, as a slow filesystem
    would make it take longer; on the first attempt only, unless fault.every_attempt."""
    if step != fault_cfg.slow_save_step or fault_cfg.slow_save_s <= 0:
        return 0.0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not fault_cfg.every_attempt:
        return 0.0
    log.warning("fault.slow_save_step=%d: its background write waits %g s first", step, fault_cfg.slow_save_s)
    return fault_cfg.slow_save_s


def slow_down(module, fault_cfg, rank: int) -> None:
    """fault.slow_rank: that rank sleeps fault.slow_ms at the start of every training forward, as a
    slower GPU or a busier host would make it compute longer (a straggler). fault.slow_val_ms: every
    rank sleeps that long at the start of every validation forward (a long validation)."""
    slow_training = rank == fault_cfg.slow_rank
    if not slow_training and fault_cfg.slow_val_ms <= 0:
        return
    if slow_training:
        log.warning("fault.slow_rank=%d: every training forward of this rank takes %g ms longer", rank, fault_cfg.slow_ms)

    def sleep(module, args) -> None:
        if module.training and slow_training:
            time.sleep(fault_cfg.slow_ms / 1000)
        elif not module.training and fault_cfg.slow_val_ms > 0:
            log.info("fault.slow_val_ms: this validation batch takes %g ms longer", fault_cfg.slow_val_ms)
            time.sleep(fault_cfg.slow_val_ms / 1000)

    module.register_forward_pre_hook(sleep)


class FaultPlan:
    """fault.plan: a JSON list of faults, each thrown once, by its rank, when the run first reaches its step (or the
    first step after it); a storm of them is tests/soak.py's. Each fault is `{"kind", "step", "rank"}` (rank 0's where
    the kind has no rank), plus `delay_ms` for a kill and `at` (0 to 1) for a corruption. Kinds:
    - `kill_rank`: SIGKILL of the rank, `delay_ms` after the step, wherever it is then;
    - `kill_worker`: SIGKILL of one of the rank's loader workers;
    - `kill_in_save`: SIGKILL of rank 0 inside the first checkpoint save from the step on, its file written but not
      yet in place;
    - `stop`: SIGTERM to rank 0's parent, torchrun (a preemption), which then stops every rank;
    - `corrupt`: after the first checkpoint save from the step on, a bit flipped in the tensor data of the file just
      saved (at `at` of it), then a SIGKILL of rank 0, so that the restart must resume past it.
    The saves' are a plain checkpoint's (a file).
    Each is written to `<plan>.thrown` (one JSON line) before it is thrown, so that no restart or relaunch throws it
    again, and the soak can say what was thrown."""

    KINDS = ("kill_rank", "kill_worker", "kill_in_save", "stop", "corrupt")

    def __init__(self, path: str, rank: int):
        self.journal = Path(f"{path}.thrown")
        thrown = {json.loads(line)["id"] for line in self.journal.read_text().splitlines()} if self.journal.exists() else set()
        faults = [dict(fault, id=index) for index, fault in enumerate(json.loads(Path(path).read_text()))]
        self.left = [fault for fault in faults if fault["id"] not in thrown and fault.get("rank", 0) == rank]

    @classmethod
    def of(cls, fault_cfg, rank: int) -> "FaultPlan | None":
        return cls(fault_cfg.plan, rank) if fault_cfg.plan else None

    def at_step(self, step: int) -> None:
        """Throws this rank's faults due at `step` (the saves' wait for a save), in the plan's order, until one ends the
        process."""
        for fault in [fault for fault in self.left if fault["step"] <= step and fault["kind"] in ("kill_rank", "kill_worker", "stop")]:
            kind = fault["kind"]
            if kind == "kill_rank":
                self._throw(fault, step)  # recorded now: the kill comes later, wherever the rank is then
                threading.Timer(fault.get("delay_ms", 0) / 1000, os.kill, (os.getpid(), signal.SIGKILL)).start()
                return
            if kind == "kill_worker":
                self._throw(fault, step)
                _kill_a_loader_worker(fault.get("worker", 0))
            else:
                self._throw(fault, step)
                os.kill(os.getppid(), signal.SIGTERM)
                return

    def in_save(self, step: int) -> None:
        """Inside the save of `step`'s checkpoint, written but not in place: a due kill_in_save kills this rank."""
        if fault := self._due("kill_in_save", step):
            self._throw(fault, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_save(self, step: int, path: Path) -> None:
        """After the save of `step`'s checkpoint to `path`: a due corruption flips a bit of it and kills this rank."""
        if fault := self._due("corrupt", step):
            self._throw(fault, step)
            flip_a_bit_of_tensor_data(path, fault.get("at", 0.5))
            os.kill(os.getpid(), signal.SIGKILL)

    def _due(self, kind: str, step: int) -> dict | None:
        return next((fault for fault in self.left if fault["kind"] == kind and fault["step"] <= step), None)

    def _throw(self, fault: dict, step: int) -> None:
        self.left.remove(fault)
        log.warning("fault.plan: %s (fault %d) at step %d", fault["kind"], fault["id"], step)
        with open(self.journal, "a") as journal:  # one whole line, before the fault
            journal.write(json.dumps(fault | {"thrown_at_step": step}) + "\n")


def _kill_a_loader_worker(which: int) -> None:
    """SIGKILL of one of this rank's DataLoader workers (the `which`-th alive, modulo their number): the children of
    its fork server, a child of the rank (Linux)."""
    def children(pid: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            found += [int(child) for child in (task / "children").read_text().split()]
        return found

    workers = sorted(worker for server in children(os.getpid()) for worker in children(server))
    if workers:
        os.kill(workers[which % len(workers)], signal.SIGKILL)
    else:
        log.warning("fault.plan: kill_worker found no loader worker alive")


def flip_a_bit_of_tensor_data(path: Path, at: float) -> None:
    """One bit flipped in a torch.save file's tensor records (the `data/` ones), at fraction `at` of their bits."""
    with zipfile.ZipFile(path) as archive:
        records = [record for record in archive.infolist() if "/data/" in record.filename and record.file_size]
    offset, bit = divmod(int(at * 8 * sum(record.file_size for record in records)), 8)
    with open(path, "r+b") as file:
        for record in records:
            if offset < record.file_size:
                file.seek(record.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", file.read(4))
                file.seek(record.header_offset + 30 + name_length + extra_length + offset)
                byte = file.read(1)[0]
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte ^ 1 << bit]))
                return
            offset -= record.file_size


class SampleRecorder:
    """fault.record_samples_dir: every rank appends one JSON line per batch it trains, with the
    dataset indices, the epoch and the update (global step) the batch counts toward, to
    `<dir>/rank<R>_attempt<A>.jsonl` (A: torchrun's restart count). A test can then check that each
    sample was trained once, across kills, restarts and world sizes."""

    def __init__(self, directory: str, rank: int, batch_size: int):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.path = Path(directory) / f"rank{rank}_attempt{attempt}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size

    def start_epoch(self, sampler, epoch: int, first_batch: int) -> Callable[[int, int], None]:
        """The epoch's `record_batch(batch_index, step)`, for a loader whose first batch is the epoch's
        `first_batch`-th (a resume's). The loader batches the sampler's indices in order (no
        drop_last), so batch i holds indices[(i - first_batch) * batch_size:][:batch_size]."""
        indices = sampler.indices()  # TrainSampler's, without starting its prefetch of remote shards

        def record_batch(batch_index: int, step: int) -> None:
            start = (batch_index - first_batch) * self.batch_size
            ids = indices[start:start + self.batch_size]
            with open(self.path, "a") as f:  # whole lines, even if the process is killed next
                f.write(json.dumps({"epoch": epoch, "step": step, "batch": batch_index, "ids": ids}) + "\n")

        return record_batch
