"""Train a model on one device, with DataParallel, or with DDP under torchrun; what it learns is the task's (tasks/).

    python train.py                                            # strategy=single (or dp)
    torchrun --nproc_per_node=2 train.py strategy=ddp syncbn=true
"""

import contextlib
import functools
import gc
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if __name__ in ("__main__", "__mp_main__") and "torch" not in sys.modules:  # a rank (__mp_main__: our launcher's)
    gc.disable()  # Python's garbage collector waits out the imports
import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data import build_datasets, report_skipped_samples
from ddp.checkpoints.best import BestTracker, check_best_settings, objective_key
from ddp.checkpoints.checkpointer import Checkpointer
from ddp.checkpoints.resume import check_resume_fits, find_resume_checkpoint, is_restart, load_resumed_weights, resume_training
from ddp.config.checks import check_model_accepts, validate
from ddp.config.schema import MULTI_PROCESS, register_configs
from ddp.distributed.env import DistEnv, collect_after_imports, process_gpus, resolve_backend, restrict_visible_gpus, select_device, set_up_process
from ddp.distributed.fsdp import check_blocks
from ddp.distributed.process_group import all_reduce_sum, process_group, releases_process_groups, replicas_identical
from ddp.jobs.failures import end_failed_job, record, startup_passed
from ddp.jobs.housekeeping import Housekeeping
from ddp.jobs.launch import launch_workers
from ddp.jobs.preemption import StopOnSignal, resume_command
from ddp.jobs.run_dir import register_resolvers
from ddp.loading.batches import BatchPlacement, batch_size, sample_image
from ddp.loading.loader_workers import start_worker_server
from ddp.loading.loaders import build_train_loader, build_val_loader, iterate_from, start_epoch
from ddp.reporting.meter import reset_peak_memory
from ddp.reporting.monitor import RunMonitor
from ddp.reporting.profiling import cuda_memory_history
from ddp.reporting.rank_zero import quiet_console_on_other_ranks
from ddp.reporting.results import log_hparams, log_results, log_setup, training_results, write_results
from ddp.reporting.tracker_checks import check_trackers
from ddp.run_context import RunContext
from ddp.training.evaluation import Validator
from ddp.training.faults import SampleRecorder, slow_down
from ddp.training.frozen import check_frozen_fits, prepare_frozen
from ddp.training.optimizer import build_optimizer, build_scheduler, check_optimizer, check_schedule, scaled_lr
from ddp.training.progress import Position, TrainingLength
from ddp.training.update import UpdateStep
from ddp.training.wrap import prepare_model, seed_this_rank
from evaluate import eval_startup, evaluate_checkpoint, use_checkpoint_task
from models import build_model
from tasks import build_task


@releases_process_groups  # before Python exits: a gloo thread still at work then aborts the rank
def run(cfg: DictConfig, run_dir: Path, relaunch: str) -> dict:
    """The whole run; returns the final metrics (also run_dir/results.json on rank 0). `relaunch` continues it after an interruption."""
    env = DistEnv.from_environ()
    quiet_console_on_other_ranks(env)
    validate(cfg, launched=env.launched, world_size=env.world_size)  # the config, before anything starts or is written
    restrict_visible_gpus(cfg.devices)  # before the first CUDA call below
    backend = resolve_backend(cfg.backend, torch.cuda.is_available())
    device = select_device(env, backend if cfg.strategy.name in MULTI_PROCESS else None, torch.cuda.device_count())
    gpus = process_gpus(cfg.strategy.name, device)
    set_up_process(cfg.deterministic, cfg.keep_freed_host_memory)  # cuDNN's algorithms; malloc keeps freed memory
    ctx = RunContext(cfg, env, backend, device, gpus, run_dir, relaunch, reset_peak_memory(gpus))  # what every stage reads; memory peaks from here
    if cfg.mode == "eval":
        return evaluate_checkpoint(ctx)  # evaluate.py, the recipe of mode=eval: its data, task and model
    splits, task, length, model, resumed = check_startup(cfg, run_dir, world_size=env.world_size, restarted=is_restart(env))
    start_worker_server(splits.train, cfg.data.num_workers)  # for DataLoader workers, while the rank sets up (loading/loader_workers.py)
    with process_group(backend, env, device, cfg.strategy.timeout_s) if ctx.distributed else contextlib.nullcontext():
        with cuda_memory_history(ctx):  # profiler.memory_history: allocations recorded, a snapshot on out-of-memory
            return fit(ctx, splits, task, length, model, resumed)


def check_startup(cfg: DictConfig, run_dir: Path, *, world_size: int, restarted: bool) -> tuple:
    """Training's checks that need the data and model (one-line ConfigErrors), before any process group; main runs them in a
    self-launching process too, so no worker starts for a refused config. Returns (splits, task, length, model, resumed)."""
    torch.manual_seed(cfg.seed)  # data, task and model: identical on every rank (same seed)
    splits = build_datasets(cfg.data)
    task = build_task(cfg.task, splits.num_classes, splits.class_names, splits.in_channels, cfg.data.get("views", 1))
    check_trackers(cfg.logger)  # logger=mlflow, wandb: installed, their settings usable
    length = TrainingLength.of(cfg.trainer, len(splits.train), cfg.data.batch_size, world_size)
    check_schedule(cfg.scheduler, length.total_updates, length.updates_per_epoch)
    check_optimizer(cfg.optim)  # on a dummy parameter: the real optimizer needs the wrapped model
    model = build_model(cfg.model, splits.num_classes, splits.in_channels, with_heads=task.with_heads)
    check_model_accepts(model, sample_image(splits.val[0]))
    check_blocks(model, cfg.strategy, cfg.activation_checkpointing)
    resumed = find_resume_checkpoint(cfg.resume, run_dir, restarted)
    if resumed:  # weights load before wrapping, so DDP starts every rank from them
        check_resume_fits(resumed[1], resumed[0], cfg, world_size, length.train_size)
        load_resumed_weights(model, resumed)
        check_frozen_fits(task, resumed[1], resumed[0])
    check_best_settings(cfg.checkpoint, cfg.trainer, cfg.task, run_epochs=length.epochs, task=task, model=model,
                        val_split=splits.val, resumed=resumed)
    startup_passed(run_dir)  # under torchrun: a rank these checks refused prints its own line (ddp/jobs/failures.py)
    return splits, task, length, model, resumed


@record  # a failing rank's traceback reaches torchrun's error summary (Hydra would swallow it)
def fit(ctx: RunContext, splits, task, length: TrainingLength, model, resumed) -> dict:
    """Set up training (loaders, model, update, the resumed position), train, save, and report."""
    cfg, env, device = ctx.cfg, ctx.env, ctx.device
    train_loader = build_train_loader(splits.train, cfg.data, env, cfg.seed, pin_memory=ctx.pin_memory)
    val_loader = build_val_loader(splits.val, cfg.data, env, pin_memory=ctx.pin_memory)
    model, raw_model, trained, ema = prepare_model(model, ctx)
    prepare_frozen(task, device)  # a teacher: on the device, eval, no gradients; never wrapped or trained
    lr = scaled_lr(cfg.optim, length.global_batch)
    optimizer = build_optimizer(cfg.optim, model.parameters(), lr)
    scheduler = build_scheduler(cfg.scheduler, optimizer, length.total_updates, length.updates_per_epoch)
    update = UpdateStep(model, optimizer, task=task, precision=cfg.precision, scheduler=scheduler, clip_norm=cfg.trainer.gradient_clip_norm,
                        ema=ema, placement=BatchPlacement(cfg.channels_last, train_loader.dataset.image_normalization))
    seed_this_rank(model, cfg.seed + env.rank)  # per-rank randomness (dropout) from here on
    position, rank_state = (resume_training(resumed, update, lr, length, cfg.data.batch_size, env.world_size, env.rank)
                            if resumed else (Position(), None))  # at this run's LR and length
    position.epoch_totals = position.epoch_totals.to(device)
    best = BestTracker.of(cfg.checkpoint, cfg.trainer, cfg.task, resumed[1] if resumed else None)  # a resume's record goes on
    validator = Validator(ctx, model, raw_model, ema, val_loader, task)
    baselines = validator.validate_baselines()  # e.g. the teacher's val metrics: what the model is chasing
    checkpointer = Checkpointer(ctx, update, raw_model, length=length, saved_step=position.global_step if resumed else -1, best=best)
    monitor = RunMonitor(ctx, trained, length, start_step=position.global_step, resumed=bool(resumed))
    monitor.mark_phases(update, validator, checkpointer)  # profiler.enabled only: phases named in the trace
    slow_down(trained, cfg.fault, env.rank)  # testing aid; after the monitor's compute timer hooks in, so it counts it
    recorder = SampleRecorder(cfg.fault.record_samples_dir, env.rank, cfg.data.batch_size) if cfg.fault.record_samples_dir else None
    house = Housekeeping(StopOnSignal.of(cfg.trainer, env, device, ctx.relaunch), monitor, checkpointer, validator, best, recorder)
    with house.stopper, monitor:  # from here SIGTERM and Ctrl-C stop the run at a step, with a checkpoint
        log_setup(cfg, env.world_size, device, length, lr, len(splits.val), baselines)
        started = time.perf_counter()
        metrics = train(ctx, update, train_loader, position, rank_state, length, house)
        wall_s = time.perf_counter() - started
        checkpointer.save_if_unsaved(position)  # save (and wait for it: checkpoint.async_save) and summarise (rank 0)
        log_hparams(monitor.writer, cfg, length, lr, env.world_size, metrics, position.global_step)
        performance = monitor.performance(wall_s, update.state_bytes(), position.global_step) | {"checkpoint_blocked_s": checkpointer.blocked_s}
    results = training_results(ctx, metrics | baselines, best.results(), position, length, lr, performance)
    results |= {"replicas_identical": replicas_identical(raw_model, include_buffers=True),
                "bad_samples_skipped": report_skipped_samples(splits, device)}  # data.on_bad_sample=skip
    write_results(results, ctx.run_dir, env)
    return results


def train(ctx: RunContext, update: UpdateStep, train_loader, position: Position, rank_state, length: TrainingLength,
          house: Housekeeping) -> dict[str, float]:
    """The loop: epochs of updates, each followed by the run's housekeeping; validation and saves. Returns the last metrics."""
    trainer, metrics = ctx.cfg.trainer, {}
    stopper, monitor, checkpointer, validator, best = house.stopper, house.monitor, house.checkpointer, house.validator, house.best
    while position.epoch < trainer.max_epochs and position.global_step < length.max_steps and not best.stop:
        epoch_started = time.perf_counter()
        start_epoch(train_loader, position.epoch, position.samples_in_epoch(length.samples_per_batch, length.train_size))
        epoch_batches = min(position.batch_in_epoch + len(train_loader), length.batches_per_epoch)
        restore = functools.partial(checkpointer.restore_rank_state, rank_state) if rank_state else None
        batches, rank_state = iterate_from(train_loader, position.batch_in_epoch, epoch_batches, restore), None
        record_batch = house.recorder.start_epoch(train_loader.sampler, position.epoch, position.batch_in_epoch) if house.recorder else None
        updates = train_one_epoch(update, monitor.start_epoch(batches, position.global_step), epoch_batches, position, length,
                                  ctx.env.world_size, record_batch)
        for loss, global_samples, epoch_ends in updates:
            agreed_stop = monitor.after_update(update, loss, position.global_step, global_samples, epoch_ends, stopper.received)
            if signum := stopper.stop_requested(position.global_step, epoch_ends, agreed_stop):
                checkpointer.save_if_unsaved(position)  # and waits for it (checkpoint.async_save)
                raise stopper.stopped(signum, position.global_step, position.epoch)
            # At an epoch's last step the save waits for validation, so a resume never repeats it.
            if checkpointer.due(position.global_step) and not epoch_ends:
                with monitor.paused():
                    checkpointer.save(position)
        monitor.end_epoch()
        loss_sum, count = all_reduce_sum(position.epoch_totals.clone()).tolist()
        metrics = {"train_loss": loss_sum / max(count, 1)}
        monitor.log_epoch(position.global_step, metrics["train_loss"], epoch_time_s=time.perf_counter() - epoch_started)
        last_epoch = position.epoch == trainer.max_epochs - 1 or position.global_step >= length.max_steps
        if (position.epoch + 1) % trainer.val_every_n_epochs == 0 or last_epoch:
            metrics |= validator.validate()
            monitor.log_validation(metrics, position.global_step, position.epoch)
            best.update(metrics, position.global_step, position.epoch)  # agreed by every rank: keep as best, stop early
            monitor.log_best(best.metric, best.best["value"], position.global_step)
            validator.log_extras(monitor.writer, position.global_step)
        # A max_steps stop mid-epoch stays where it is (epoch, batch, partial sums): a longer run resumed from it continues exactly.
        if position.batch_in_epoch >= epoch_batches:
            position.epoch, position.batch_in_epoch, position.epoch_start = position.epoch + 1, 0, 0
            position.epoch_totals = torch.zeros_like(position.epoch_totals)
        if checkpointer.due(position.global_step):  # periodic, or a best validation's (after it: a resume won't repeat it)
            checkpointer.save(position)
    monitor.close_progress()
    if "val_loss" not in metrics:  # resumed from a finished run: report its metrics again
        metrics |= validator.validate()
    return metrics


def train_one_epoch(update: UpdateStep, batches, epoch_batches: int, position: Position, length: TrainingLength,
                    world_size: int, record_batch=None) -> Iterator[tuple[torch.Tensor, int, bool]]:
    """Train on `batches` ((index, batch) pairs up to the epoch's `epoch_batches`) in groups of accumulate micro-batches
    (an epoch's last may be shorter), yielding after each group's update: (its last micro-batch's loss, its samples
    over all ranks, whether the epoch ends). No batch past the run's last update is loaded. `record_batch`: fault aid."""
    update.model.train()
    group_samples, first_batch, loss_sum, sample_count = 0, None, position.epoch_totals[:1], position.epoch_totals[1:]  # views
    for batch_index, batch in batches:
        if record_batch is not None:
            record_batch(batch_index, position.global_step + 1)  # the update this batch counts toward
        first_batch = batch_index if first_batch is None else first_batch
        aligned_start = batch_index - batch_index % length.accumulate
        # a resume at another world size may land inside a group: that group starts where the resume does
        group_start = max(aligned_start, first_batch)
        group_size = min(aligned_start + length.accumulate, epoch_batches) - group_start
        loss = update.micro_step(batch, batch_index - group_start, group_size)
        position.batch_in_epoch, samples = batch_index + 1, batch_size(batch)
        loss_sum.add_(loss, alpha=samples)  # in float64, on the device: no host sync per step
        sample_count.add_(samples)
        group_samples += samples
        if position.batch_in_epoch - group_start < group_size:
            continue  # the update comes with the group's last micro-batch
        position.global_step += 1
        epoch_ends = position.batch_in_epoch == epoch_batches or position.global_step >= length.max_steps
        yield loss, group_samples * world_size, epoch_ends
        group_samples = 0
        if epoch_ends:  # before the next batch loads: without workers, loading draws from the global RNG
            return


register_configs()
register_resolvers()
collect_after_imports()  # on again (where the top turned it off), the imports' objects left out of its scans


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the task's objective (`objective_key`: the final, the best, or data.split's): what a sweeper optimises."""
    hydra_cfg = HydraConfig.get()
    run_dir, env = Path(hydra_cfg.runtime.output_dir), DistEnv.from_environ()
    relaunch = resume_command(sys.argv[0], list(hydra_cfg.overrides.task), env.local_world_size if env.launched else None, run_dir)
    try:
        use_checkpoint_task(cfg, run_dir, list(hydra_cfg.overrides.task))  # mode=eval: the checkpoint's task, as its model
        if cfg.strategy.name in MULTI_PROCESS and not env.launched and (nproc := cfg.strategy.nproc_per_node) > 0:
            validate(cfg, launched=True, world_size=nproc)  # fail here, not in N workers
            if cfg.mode == "eval":
                eval_startup(cfg)
            else:
                check_startup(cfg, run_dir, world_size=nproc, restarted=False)
            results = launch_workers(run, cfg, run_dir, relaunch, hydra_cfg.job.name, nproc, cfg.strategy.max_restarts)
        else:
            results = run(cfg, run_dir, relaunch)
    except BaseException as error:
        raise end_failed_job(error, hydra_cfg, cfg, env)  # or exits
    if env.is_main:
        log_results(results, run_dir, cfg.mode, cfg.logger)
    return results[objective_key(cfg.task.objective, cfg.trainer.objective, cfg.checkpoint.best_of, cfg.mode, cfg.data.split)]


if __name__ == "__main__":
    main()
