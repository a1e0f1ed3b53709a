"""What the run watches between updates: the progress bar, the training scalars, the throughput,
data-wait and straggler meters, the fault aids, the non-finite check, and the profiler when it is on
(ddp/reporting/profiling.py). Stopping at a signal is StopOnSignal's (ddp/jobs/preemption.py), beside
it in the loop."""

import contextlib
import copy
import logging
import sys
import time
from collections.abc import Iterable, Iterator

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from ddp.distributed.process_group import gather_per_rank
from ddp.reporting.meter import ComputeTimer, ThroughputMeter, peak_memory, straggler_stats
from ddp.reporting.profiling import StepProfiler, dump_memory_snapshot, marked_batches
from ddp.reporting.rank_zero import RankZeroWriter
from ddp.reporting.tracker_process import TrackerProcess
from ddp.reporting.trackers import PointJournal, TrackedRun, picked
from ddp.run_context import RunContext
from ddp.training.faults import FaultPlan, inject_fault

log = logging.getLogger("train")  # the run's own console lines, under the script's name


class RunMonitor:
    """A context manager for the training loop: inside it `writer` is the run's TensorBoard writer and
    trackers (the logger group's; rank 0 only), closed however the run ends.

    Reads of the device (loss, gradient norm, the finite check, the ranks' meters) happen only at
    log steps and epoch ends, where the loop waits for the device anyway."""

    def __init__(self, ctx: RunContext, trained_module: torch.nn.Module, length, *, start_step: int, resumed: bool):
        trainer_cfg, env, device = ctx.cfg.trainer, ctx.env, ctx.device
        self.log_every_n_steps, self.fault_cfg, self.env, self.device = trainer_cfg.log_every_n_steps, ctx.cfg.fault, env, device
        self.fault_at_step, self.fault_plan = ctx.cfg.fault.at_step, FaultPlan.of(ctx.cfg.fault, env.rank)
        self.global_batch = length.global_batch
        self.cuda_devices, self.memory_reset = ctx.gpus, ctx.memory_reset
        self.meter = ThroughputMeter(trainer_cfg.warmup_steps, device)
        # this rank's own compute per update: shows a straggler
        self.compute_timer = ComputeTimer(trained_module, device, trainer_cfg.warmup_steps)
        self.progress = tqdm(total=length.total_updates, initial=start_step, desc="train",
                             disable=not (env.is_main and sys.stderr.isatty()))
        # a resumed run drops the events the interrupted one logged after its checkpoint
        self.run_dir, self.purge_step = ctx.run_dir, start_step + 1 if resumed else None
        self.cfg = ctx.cfg
        self.writer: RankZeroWriter | None = None
        self._logged_step, self._logged_at = start_step, time.perf_counter()
        # profiler.*: None when off, so the loop runs exactly as without it
        self.profiler = StepProfiler(ctx) if ctx.cfg.profiler.enabled else None
        self.memory_snapshot_step = ctx.cfg.profiler.memory_snapshot_step

    def __enter__(self) -> "RunMonitor":
        self._exit_stack = contextlib.ExitStack()
        logger, trackers, journal = self.cfg.logger, [], None
        if self.env.is_main and [name for name in picked(logger) if name != "tensorboard"]:
            journal = PointJournal(self.run_dir, self.purge_step)
            # started, fed and ended in a process of their own, so the loop doesn't wait for them (docs/tracking.md, Cost);
            # its thread reads a copy of the config: OmegaConf isn't made for reads from two threads at once
            cfg, run_dir, earlier = copy.deepcopy(self.cfg), self.run_dir, journal.earlier
            trackers = [TrackerProcess(lambda: (OmegaConf.to_container(cfg.logger, resolve=True), TrackedRun.of(cfg, run_dir), earlier))]
        self.writer = self._exit_stack.enter_context(RankZeroWriter(
            self.run_dir, self.env, purge_step=self.purge_step, tensorboard="tensorboard" in picked(logger), trackers=trackers,
            journal=journal))
        if self.profiler is not None:
            self._exit_stack.enter_context(self.profiler)
        return self

    def __exit__(self, *exc_info) -> None:
        self._exit_stack.__exit__(*exc_info)

    def mark_phases(self, update, validator, checkpointer) -> None:
        """When profiling: the update's phases, validation and saves marked in the trace."""
        if self.profiler is not None:
            self.profiler.mark_phases(update, validator, checkpointer)

    def start_epoch(self, batches: Iterable, step: int) -> Iterator:
        """`batches`, timed for the data-wait meter (and marked, when profiling); the throughput clock runs from here."""
        self._logged_step, self._logged_at = step, time.perf_counter()
        self.meter.resume()
        timed = self.meter.timed(batches)
        return marked_batches(timed) if self.profiler is not None else timed

    def end_epoch(self) -> None:
        """The throughput clock stops: the epoch-end work isn't training."""
        self.meter.pause()

    def log_epoch(self, step: int, train_loss: float, epoch_time_s: float) -> None:
        self.writer.add_scalar("train/epoch_loss", train_loss, step)
        self.writer.add_scalar("train/epoch_time_s", epoch_time_s, step)
        self.writer.commit()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that isn't training (a periodic save) stays out of the throughput."""
        self.meter.pause()
        yield
        self.meter.resume()

    def after_update(self, update, loss: torch.Tensor, step: int, global_samples: int, epoch_ends: bool,
                     stop_signal: int = 0) -> int | None:
        """Everything after update `step` but the stop check and the saves. At log steps and an epoch's
        end, where the loop waits anyway, the ranks agree in one all_gather on whether every loss was
        finite (else Diverged), on this rank's `stop_signal` (the largest is returned, for the stop
        check), and, at log steps, on each rank's data wait and compute; else None."""
        log_step = step % self.log_every_n_steps == 0
        if log_step:
            self._log_training(update, loss, step)
        self.progress.update(1)
        self.meter.step(global_samples)
        self.compute_timer.update_done()
        if step == self.fault_at_step:  # read once: a DictConfig attribute costs microseconds every step
            inject_fault(self.fault_cfg, self.env.rank, step)
        if self.fault_plan is not None:
            self.fault_plan.at_step(step)
        agreed_stop = None
        if log_step or epoch_ends:
            timings = [self.meter.window_data_wait(), self.compute_timer.window_per_update()] if log_step else [0.0, 0.0]
            per_rank = gather_per_rank([float(update.finite.item()), float(stop_signal), *timings], self.device)
            update.checked(step, all(rank[0] for rank in per_rank))
            agreed_stop = int(max(rank[1] for rank in per_rank))
            if log_step:
                self._log_ranks(step, [rank[2:] for rank in per_rank])
                self.writer.commit()
        if self.profiler is not None:
            self.profiler.step(step)
        if step == self.memory_snapshot_step:
            dump_memory_snapshot(self.run_dir, f"memory_rank{self.env.rank}_step{step}.pickle")
        return agreed_stop

    def _log_training(self, update, loss: torch.Tensor, step: int) -> None:
        loss_value = loss.item()  # waits for the device, so the clock below counts the work done
        now = time.perf_counter()
        self.writer.add_scalar("train/loss", loss_value, step)
        for name, term in update.terms.items():  # the task's extra loss terms (its training_step)
            self.writer.add_scalar(f"train/{name}", term.item(), step)
        self.writer.add_scalar("train/lr", update.lr, step)
        if update.grad_norm is not None:
            self.writer.add_scalar("train/grad_norm", update.grad_norm.item(), step)
        samples_per_s = (step - self._logged_step) * self.global_batch / (now - self._logged_at)
        self.writer.add_scalar("train/samples_per_s", samples_per_s, step)
        self.writer.add_scalar("train/samples_per_s_per_rank", samples_per_s / self.env.world_size, step)
        self._logged_step, self._logged_at = step, now

    def _log_ranks(self, step: int, per_rank: list[list[float]]) -> None:
        """Each rank's share of the window spent waiting for data, and its compute per update."""
        waits = [rank[0] for rank in per_rank]
        self.writer.add_scalar("perf/data_wait_fraction", sum(waits) / self.env.world_size, step)
        self.writer.add_scalar("perf/data_wait_fraction_max", max(waits), step)
        for name, value in straggler_stats([rank[1] for rank in per_rank]).items():
            self.writer.add_scalar(f"perf/{name}", value, step)

    def log_validation(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        for key, value in metrics.items():
            if key.startswith("val_") and key != "val_samples":
                self.writer.add_scalar(key.replace("val_", "val/", 1), value, step)
        log.info("epoch %d step %d: %s", epoch, step,
                 " ".join(f"{key}={value:.4f}" for key, value in metrics.items() if key != "val_samples"))

    def log_best(self, metric: str, value: float, step: int) -> None:
        """The best so far of the metric that ranks validations, e.g. val/best_accuracy."""
        self.writer.add_scalar(metric.replace("val_", "val/best_", 1), value, step)
        self.writer.commit()

    def close_progress(self) -> None:
        self.progress.close()

    def performance(self, wall_s: float, state_bytes: list[int], step: int) -> dict:
        """The run's throughput, memory and straggler figures, with every rank's (a collective).
        `state_bytes`: this rank's bytes of parameters, gradients and optimizer state (UpdateStep.state_bytes),
        also logged to TensorBoard at `step` as memory/<kind>_bytes/rank<R>."""
        peak_mb, peak_device = peak_memory(self.cuda_devices, self.memory_reset)
        self.compute_timer.window_per_update()  # counts the last window
        per_rank = gather_per_rank([self.meter.data_wait_fraction, peak_mb, self.compute_timer.per_update, *state_bytes],
                                   self.device)
        samples_per_s = self.meter.samples_per_s
        state_bytes_per_rank = {f"{kind}_bytes_per_rank": [int(rank[3 + i]) for rank in per_rank]
                                for i, kind in enumerate(("parameter", "gradient", "optimizer_state"))}
        for key, per_rank_bytes in state_bytes_per_rank.items():
            for rank, value in enumerate(per_rank_bytes):
                self.writer.add_scalar(f"memory/{key.removesuffix('_per_rank')}/rank{rank}", value, step)
        self.writer.commit()
        return {
            "samples_per_s": samples_per_s,
            "samples_per_s_per_rank": samples_per_s / self.env.world_size if samples_per_s else None,
            "data_wait_fraction_per_rank": [rank[0] for rank in per_rank],
            "train_time_s": self.meter.seconds,
            "wall_s": wall_s,
            "peak_memory_mb": peak_mb,
            "peak_memory_device": peak_device,
            "peak_memory_mb_per_rank": [rank[1] for rank in per_rank],
            "compute_s_per_update_per_rank": [rank[2] for rank in per_rank],
            "straggler_ratio": straggler_stats([rank[2] for rank in per_rank])["straggler_ratio"],
            **state_bytes_per_rank,
        }
