"""The run's checkpoints: what was saved, the collective save (here or in the background), and when one is due."""

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from ddp.checkpoints.best import BestTracker
from ddp.checkpoints.checkpoint import DiskFull, keep_best_checkpoints, save_step_checkpoint
from ddp.checkpoints.resume import capture_rank_state, checkpoint_state, gather_rank_states, restore_rank_state
from ddp.distributed.dtensor import is_sharded
from ddp.run_context import RunContext
from ddp.training.faults import FaultPlan, save_delay_s
from ddp.training.frozen import check_frozen_unchanged, frozen_fingerprints
from ddp.training.progress import Position, TrainingLength

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves the run at an update boundary: every rank contributes its RNG state, rank 0
    writes (atomically, ddp/checkpoints/checkpoint.py; under fsdp every rank writes its shards and rank 0 publishes
    the dir, ddp/checkpoints/sharded_checkpoint.py), and nobody runs ahead before the checkpoint exists. Never saves
    non-finite weights. Remembers the step it saved last, so the end of the run saves only if needed.
    Every checkpoint holds `best`'s record; a save at a step whose validation entered the kept best
    ones is kept as best-<step>.pt too (checkpoint.keep_best).

    checkpoint.async_save: a save copies the state and returns; a thread writes the copy, then keeps it as
    best and prunes the old ones, so those follow completed saves only. One save at most is in flight: the
    next save, a stop and the end of the run first wait for it (`finish`), and every rank learns there of a
    failure (a full disk), as after a save here. Sharded checkpoints are written over a gloo process group of
    their own: on the training's, a save's collectives would meet the training's (and abort the job)."""

    def __init__(self, ctx: RunContext, update, raw_model: nn.Module, *, length: TrainingLength,
                 saved_step: int, best: BestTracker):
        self.run_dir, self.env = ctx.run_dir, ctx.env
        self.every_n_steps, self.keep_last = ctx.cfg.checkpoint.every_n_steps, ctx.cfg.checkpoint.keep_last
        self.update, self.raw_model, self.optimizer = update, raw_model, update.optimizer
        self.cuda_devices = ctx.gpus
        self.length = length
        self.config = OmegaConf.to_container(ctx.cfg, resolve=True)  # the run's resolved config, as plain containers
        self.frozen = frozen_fingerprints(update.task)  # a resume must use the same frozen modules (a teacher)
        self.saved_step = saved_step  # -1: nothing saved by this run or the one it resumes
        self.best = best
        self.fault, self.fault_plan = ctx.cfg.fault, FaultPlan.of(ctx.cfg.fault, ctx.env.rank)
        self.in_background = ctx.cfg.checkpoint.async_save
        # a collective, on every rank alike: the sharded save's own group
        self.save_group = dist.new_group(backend="gloo") if self.in_background and is_sharded(raw_model) else None
        self.in_flight: tuple[int, threading.Thread, list] | None = None  # the save in flight: (step, its writer, [its error])
        self.blocked_s: list[float] = []  # each save's time in the loop: the write, or the copy and a wait for the one before
        if saved_step >= 0:  # resumed
            self.tidy_best()

    def due(self, step: int) -> bool:
        """A periodic save (checkpoint.every_n_steps; 0: only at the end), or this step's validation is one to keep."""
        return bool(self.every_n_steps) and step % self.every_n_steps == 0 or self.best.save_step == step

    def tidy_best(self) -> None:
        """A resumed run's best files as its record says (a resume from an older checkpoint leaves later ones behind)."""
        if self.env.is_main and self.best.keep_best:
            keep_best_checkpoints(self.run_dir, self.best.kept_steps())

    def save(self, position: Position) -> None:
        """A collective: every rank calls it at the same step. A full disk at the save (rank 0's file; under
        fsdp, any rank's shards) raises DiskFull on every rank, with rank 0's line: here, or with
        checkpoint.async_save at the next save, stop or end (`finish`)."""
        started = time.perf_counter()
        self.finish()
        step = position.global_step
        self.update.check_finite(step, self.raw_model)
        check_frozen_unchanged(self.update.task, self.frozen, step)  # what the checkpoint records is true
        rank_states = gather_rank_states(capture_rank_state(position.epoch_totals, self.cuda_devices))
        kept_best = self.best.kept_steps() if self.env.is_main and self.best.save_step == step else None
        write = self._writer(position, rank_states)

        def write_and_keep() -> None:
            path = write()
            if kept_best is not None:
                keep_best_checkpoints(self.run_dir, kept_best, saved=(step, path))

        if self.in_background:
            self.in_flight = self._start_writer(write_and_keep if write else None, step)
        else:
            self._agree_on(self._run(write_and_keep) if write else None)
        self.saved_step = step
        self.blocked_s.append(time.perf_counter() - started)

    def _writer(self, position: Position, rank_states: list[dict]) -> Callable[[], Path] | None:
        """What writes this rank's part of the checkpoint of `position`: every rank's shards of a sharded model, rank 0's
        file otherwise; None on a rank that writes nothing."""
        step = position.global_step
        if is_sharded(self.raw_model):
            from ddp.checkpoints.sharded_checkpoint import save_sharded_checkpoint  # DCP, imported where it's used (ddp/distributed/fsdp.py)

            state = self.state(position, rank_states, sharded=True) if self.env.is_main else {}
            return save_sharded_checkpoint(self.raw_model, self.optimizer, state, self.run_dir, step, self.keep_last,
                                           group=self.save_group)
        if not self.env.is_main:
            return None
        state = self.state(position, rank_states)

        def write() -> Path:
            in_save = self.fault_plan and (lambda: self.fault_plan.in_save(step))  # fault.plan's kill_in_save
            path = save_step_checkpoint(state, self.run_dir, step, self.keep_last, before_publish=in_save)
            if self.fault_plan:
                self.fault_plan.after_save(step, path)  # fault.plan's corrupt
            return path

        return write

    def _start_writer(self, write: Callable[[], None] | None, step: int) -> tuple[int, threading.Thread, list]:
        """A thread runs `write` (rank 0's, or every rank's under fsdp; None on the other ranks), its error kept for
        `finish`. A daemon: a failed run exits without its write, which stays unpublished."""
        errors: list[BaseException | None] = []

        def run() -> None:
            if write is not None and (delay := save_delay_s(self.fault, step)):  # testing aid: a slow filesystem
                time.sleep(delay)
            errors.append(self._run(write) if write is not None else None)

        thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        thread.start()
        log.info("checkpoint of step %d: copied, being written in the background", step)
        return step, thread, errors

    @staticmethod
    def _run(write: Callable[[], None]) -> BaseException | None:
        try:
            write()
        except BaseException as error:  # reported by _agree_on, on every rank
            return error
        return None

    def finish(self) -> None:
        """checkpoint.async_save: wait for the save in flight, if any; a collective where one is (every rank calls it at
        the same step), whose failure it raises on every rank. Nothing to do without async_save."""
        if self.in_flight is None:
            return
        step, thread, errors = self.in_flight
        started = time.perf_counter()
        thread.join()
        self.in_flight = None
        if (waited := time.perf_counter() - started) > 0.01:
            log.info("checkpoint of step %d: waited %.2f s for its background write", step, waited)
        self._agree_on(errors[0])

    def _agree_on(self, error: BaseException | None) -> None:
        """Rank 0's word on its save, which nobody runs ahead of (or exits before), as a barrier would: on a full
        disk every rank stops with its line, none with a "connection reset" from a peer gone."""
        word = [None if error is None else (isinstance(error, DiskFull), str(error))]
        if dist.is_initialized():
            dist.broadcast_object_list(word, src=0)
        if error is not None and not isinstance(error, DiskFull):
            raise error
        if word[0] is not None:
            full, message = word[0]
            if not full:
                raise RuntimeError(f"rank 0's checkpoint save failed: {message}")
            error = DiskFull(message)
            error.on_every_rank = dist.is_initialized()  # every rank raises rank 0's line: rank 0 alone says it
            raise error

    def state(self, position: Position, rank_states: list[dict], sharded: bool = False) -> dict:
        """What rank 0 saves; a sharded checkpoint's model and optimizer states are in its shards. With async_save, a
        copy: training goes on changing the tensors while the background thread writes it."""
        state = checkpoint_state(None if sharded else self.raw_model, self.optimizer, self.update.state_dict(), position,
                                 position.samples_in_epoch(self.length.samples_per_batch, self.length.train_size), rank_states, self.config,
                                 copy=self.in_background)
        return state | {"best": self.best.state_dict(), "frozen": self.frozen}

    def restore_rank_state(self, rank_state: dict) -> None:
        """This rank's RNG state as a checkpoint saved it (resume_position's rank_state)."""
        restore_rank_state(rank_state, self.cuda_devices)

    def save_if_unsaved(self, position: Position) -> None:
        """The run's last save, if its step isn't saved yet; with async_save, waited for (the end, or a stop)."""
        if self.saved_step != position.global_step:
            self.save(position)
        self.finish()
