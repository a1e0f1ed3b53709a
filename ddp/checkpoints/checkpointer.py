"""The run's checkpoints: what was saved, the collective save, and when one is due."""


import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from ddp.checkpoints.best import BestTracker
from ddp.checkpoints.checkpoint import DiskFull, keep_best_checkpoints, save_step_checkpoint
from ddp.checkpoints.resume import capture_rank_state, checkpoint_state, gather_rank_states, restore_rank_state
from ddp.distributed.dtensor import is_sharded
from ddp.run_context import RunContext
from ddp.training.frozen import check_frozen_unchanged, frozen_fingerprints
from ddp.training.progress import Position


class Checkpointer:
    """Saves the run at an update boundary: every rank contributes its RNG state, rank 0
    writes (atomically, ddp/checkpoints/checkpoint.py; under fsdp every rank writes its shards and rank 0 publishes
    the dir, ddp/checkpoints/sharded_checkpoint.py), and nobody runs ahead before the checkpoint exists. Never saves
    non-finite weights. Remembers the step it saved last, so the end of the run saves only if needed.
    Every checkpoint holds `best`'s record; a save at a step whose validation entered the kept best
    ones is kept as best-<step>.pt too (checkpoint.keep_best)."""

    def __init__(self, ctx: RunContext, update, raw_model: nn.Module, *, samples_per_batch: int, train_size: int,
                 saved_step: int, best: BestTracker):
        self.run_dir, self.env = ctx.run_dir, ctx.env
        self.every_n_steps, self.keep_last = ctx.cfg.checkpoint.every_n_steps, ctx.cfg.checkpoint.keep_last
        self.update, self.raw_model, self.optimizer = update, raw_model, update.optimizer
        self.cuda_devices = ctx.gpus
        self.samples_per_batch, self.train_size = samples_per_batch, train_size
        self.config = OmegaConf.to_container(ctx.cfg, resolve=True)  # the run's resolved config, as plain containers
        self.frozen = frozen_fingerprints(update.task)  # a resume must use the same frozen modules (a teacher)
        self.saved_step = saved_step  # -1: nothing saved by this run or the one it resumes
        self.best = best
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
        fsdp, any rank's shards) raises DiskFull on every rank, with rank 0's line."""
        self.update.check_finite(position.global_step, self.raw_model)
        check_frozen_unchanged(self.update.task, self.frozen, position.global_step)  # what the checkpoint records is true
        rank_states = gather_rank_states(capture_rank_state(position.epoch_totals, self.cuda_devices))
        full = None
        try:
            if is_sharded(self.raw_model):
                from ddp.checkpoints.sharded_checkpoint import save_sharded_checkpoint  # DCP, imported where it's used (ddp/distributed/fsdp.py)

                state = self.state(position, rank_states, sharded=True) if self.env.is_main else {}
                path = save_sharded_checkpoint(self.raw_model, self.optimizer, state, self.run_dir, position.global_step, self.keep_last)
            elif self.env.is_main:
                path = save_step_checkpoint(self.state(position, rank_states), self.run_dir, position.global_step, self.keep_last)
            if self.env.is_main and self.best.save_step == position.global_step:
                keep_best_checkpoints(self.run_dir, self.best.kept_steps(), saved=(position.global_step, path))
        except DiskFull as error:
            full = str(error)
        if dist.is_initialized():
            # rank 0's word on its save, which nobody runs ahead of (or exits before), as a barrier would:
            # on a full disk every rank stops with its line, none with a "connection reset" from a peer gone
            word = [full]
            dist.broadcast_object_list(word, src=0)
            full = word[0]
        if full:
            raise DiskFull(full)
        self.saved_step = position.global_step

    def state(self, position: Position, rank_states: list[dict], sharded: bool = False) -> dict:
        """What rank 0 saves; a sharded checkpoint's model and optimizer states are in its shards."""
        state = checkpoint_state(None if sharded else self.raw_model, self.optimizer, self.update.state_dict(), position,
                                 self.samples_per_batch, self.train_size, rank_states, self.config)
        return state | {"best": self.best.state_dict(), "frozen": self.frozen}

    def restore_rank_state(self, rank_state: dict) -> None:
        """This rank's RNG state as a checkpoint saved it (resume_position's rank_state)."""
        restore_rank_state(rank_state, self.cuda_devices)

    def save_if_unsaved(self, position: Position) -> None:
        if self.saved_step != position.global_step:
            self.save(position)
