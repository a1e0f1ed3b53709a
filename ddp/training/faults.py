"""Injected faults and a record of the samples trained: testing aids for fault tolerance. Off by
default (`fault.*` = -1, `fault.record_samples_dir` = null)."""

import json
import logging
import os
import signal
import time
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
