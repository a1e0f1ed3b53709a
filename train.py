"""Train an image classifier on one device, with DataParallel, or with DDP under torchrun.

    python train.py                                            # strategy=single
    python train.py strategy=dp                                # DataParallel over visible GPUs
    torchrun --nproc_per_node=2 train.py strategy=ddp syncbn=true
    python train.py mode=eval resume=<checkpoint or run dir>   # evaluate a checkpoint, train nothing
"""

import contextlib
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from data import build_datasets
from data.mix import build_batch_mix
from data.vision import report_skipped_samples
from ddp.checkpoint import save_step_checkpoint
from ddp.config import ConfigError, check_model_accepts, instantiate_checked, optimizer_node, register_configs, validate
from ddp.env import DistEnv, restrict_visible_gpus, select_device, use_deterministic_cudnn
from ddp.faults import SampleRecorder, inject_fault, slow_down
from ddp.launch import launch_workers
from ddp.loaders import build_train_loader, build_val_loader, iterate_from, start_epoch, start_worker_server
from ddp.meter import ComputeTimer, ThroughputMeter, peak_memory, reset_peak_memory, straggler_stats
from ddp.preemption import Interrupted, StopOnSignal, resume_command, submitit_requeue_signal
from ddp.process_group import (
    all_reduce_sum,
    broadcast_buffers_from_rank_zero,
    gather_per_rank,
    process_group,
    replicas_identical,
    resolve_backend,
)
from ddp.rank_zero import RankZeroWriter, quiet_console_on_other_ranks, write_json
from ddp.resume import (
    Position,
    capture_rank_state,
    checkpoint_state,
    find_resume_checkpoint,
    gather_rank_states,
    check_update_state_fits,
    load_model_state,
    restore_rank_state,
    resume_position,
)
from ddp.run_dir import register_resolvers
from ddp.sweep_summary import record_failed_job
from ddp.syncbn import convert_syncbn
from ddp.update import Diverged, UpdateStep, build_ema, build_scheduler, check_schedule, resume_schedule, scaled_lr
from ddp.wrap import process_gpus, seed_dataparallel_replicas, wrap_model
from models import build_model

log = logging.getLogger("train")


def train_one_epoch(update, batches, epoch_batches, position, length, log_every_n_steps, world_size, writer, after_update,
                    record_batch=None) -> None:
    """Train on `batches` ((index, batch) pairs, which end at the epoch's `epoch_batches`) until they end
    or the run's last update is done; no batch past that update is loaded. Micro-batches form groups of
    trainer.accumulate_grad_batches, one optimizer update each (an epoch's last group may be shorter).
    `record_batch(index, step)`: the fault.record_samples_dir aid."""
    update.model.train()
    logged_step, logged_at = position.global_step, time.perf_counter()
    group_samples, first_batch = 0, None
    for batch_index, (images, labels) in batches:
        if record_batch is not None:
            record_batch(batch_index, position.global_step + 1)  # the update this batch counts toward
        first_batch = batch_index if first_batch is None else first_batch
        aligned_start = batch_index - batch_index % length.accumulate
        # a resume at another world size may land inside a group: that group starts where the resume does
        group_start = max(aligned_start, first_batch)
        group_size = min(aligned_start + length.accumulate, epoch_batches) - group_start
        loss = update.micro_step(images, labels, batch_index - group_start, group_size)
        position.batch_in_epoch = batch_index + 1
        position.epoch_totals[0] += loss.double() * len(labels)  # on the device: no host sync per step
        position.epoch_totals[1] += len(labels)
        group_samples += len(labels)
        if position.batch_in_epoch - group_start < group_size:
            continue  # the update comes with the group's last micro-batch

        position.global_step += 1
        if position.global_step % log_every_n_steps == 0:
            loss_value = loss.item()  # waits for the device, so the clock below counts the work done
            now = time.perf_counter()
            writer.add_scalar("train/loss", loss_value, position.global_step)
            writer.add_scalar("train/lr", update.lr, position.global_step)
            if update.grad_norm is not None:
                writer.add_scalar("train/grad_norm", update.grad_norm.item(), position.global_step)
            samples = (position.global_step - logged_step) * length.global_batch
            writer.add_scalar("train/samples_per_s", samples / (now - logged_at), position.global_step)
            writer.add_scalar("train/samples_per_s_per_rank", samples / (now - logged_at) / world_size, position.global_step)
            logged_step, logged_at = position.global_step, now
        epoch_ends = position.batch_in_epoch == epoch_batches or position.global_step >= length.max_steps
        after_update(group_samples * world_size, epoch_ends)
        group_samples = 0
        if epoch_ends:  # before the next batch loads: without workers, loading draws from the global RNG
            break


@torch.no_grad()
def evaluate(model, loader, device, limit_batches: int) -> dict[str, float]:
    """Exact metrics: every validation sample counted once across ranks, then one all_reduce."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for batch_index, (images, labels) in enumerate(loader):
        if batch_index == limit_batches:
            break
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_samples": int(count)}


def evaluate_with_ema(model, ema, loader, device, limit_batches: int) -> dict[str, float]:
    """`evaluate`, and the EMA weights' loss and accuracy too when there are any."""
    metrics = evaluate(model, loader, device, limit_batches)
    if ema is not None:
        ema_metrics = evaluate(ema.module, loader, device, limit_batches)
        metrics |= {"val_ema_loss": ema_metrics["val_loss"], "val_ema_accuracy": ema_metrics["val_accuracy"]}
    return metrics


@dataclass(frozen=True)
class TrainingLength:
    """How long the run is, in the units the loop counts."""

    batches_per_epoch: int  # micro-batches of this rank per epoch (all ranks have the same number)
    accumulate: int  # micro-batches per optimizer update
    updates_per_epoch: int
    total_updates: int  # trainer.max_epochs of them, or trainer.max_steps if that ends first (the schedule's length)
    # The loop ends after trainer.max_epochs, or at this step: not at total_updates, since a run
    # resumed at another world size has counted some of its updates in another global batch.
    max_steps: float  # trainer.max_steps, or inf
    global_batch: int  # samples per update over all ranks
    samples_per_batch: int  # samples of one micro-batch over all ranks: batch_size x world_size

    @classmethod
    def of(cls, trainer_cfg, train_size: int, batch_size: int, world_size: int) -> "TrainingLength":
        batches = math.ceil(math.ceil(train_size / world_size) / batch_size)  # DistributedSampler pads to equal shares
        if trainer_cfg.limit_train_batches != -1:
            batches = min(batches, trainer_cfg.limit_train_batches)
        accumulate = trainer_cfg.accumulate_grad_batches
        if trainer_cfg.global_batch_size is not None:  # the same global batch at any world size (validate: it divides)
            accumulate = trainer_cfg.global_batch_size // (batch_size * world_size)
        updates_per_epoch = math.ceil(batches / accumulate)
        total = updates_per_epoch * trainer_cfg.max_epochs
        if trainer_cfg.max_steps != -1:
            total = min(total, trainer_cfg.max_steps)
        max_steps = trainer_cfg.max_steps if trainer_cfg.max_steps != -1 else math.inf
        return cls(batches, accumulate, updates_per_epoch, total, max_steps, batch_size * world_size * accumulate,
                   batch_size * world_size)


def run(cfg: DictConfig, run_dir: Path, relaunch: str) -> dict:
    """The whole run; returns the final metrics (also written to run_dir/results.json on rank 0).
    `relaunch` is the command that continues it after an interruption."""
    # resolve env and check the config before anything starts or is written
    env = DistEnv.from_environ()
    validate(cfg, launched=env.launched, world_size=env.world_size)
    restrict_visible_gpus(cfg.devices)  # before the first CUDA call below
    distributed = cfg.strategy.name == "ddp"
    backend = resolve_backend(cfg.backend, torch.cuda.is_available())
    device = select_device(env, backend if distributed else None, torch.cuda.device_count())
    gpus = process_gpus(cfg.strategy.name, device)
    memory_reset = reset_peak_memory(gpus)  # peak memory is this run's, also in a multirun
    quiet_console_on_other_ranks(env)
    if cfg.syncbn and not distributed:
        log.warning("syncbn=true has no effect with strategy=%s: %s", cfg.strategy.name, SYNCBN_WITHOUT_DDP[cfg.strategy.name])
    if cfg.deterministic:
        use_deterministic_cudnn()

    # data and model: identical on every rank (same seed)
    torch.manual_seed(cfg.seed)
    splits = build_datasets(cfg.data)
    if cfg.mode == "eval":
        return evaluate_checkpoint(cfg, env, backend, device, splits, run_dir)
    length = TrainingLength.of(cfg.trainer, len(splits.train), cfg.data.batch_size, env.world_size)
    check_schedule(cfg.scheduler, length.total_updates, length.updates_per_epoch)
    model = build_model(cfg.model, splits.num_classes, splits.in_channels)
    check_model_accepts(model, splits.val[0][0])
    # the real optimizer needs the wrapped model; build one on a dummy now to reject bad settings early
    instantiate_checked(optimizer_node(cfg.optim), "optim", params=[torch.zeros(1, requires_grad=True)])
    start_worker_server(splits.train, cfg.data.num_workers)  # for DataLoader workers, while the rank sets up (ddp/loaders.py)

    # resume: weights load before wrapping, so DDP starts every rank from them
    # submitit runs a requeued job again in the same job dir; its first run finds no checkpoint there
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or env.launcher == "submitit"
    resumed = find_resume_checkpoint(cfg.resume, run_dir, restarted)
    if resumed:
        load_model_state(model, resumed[1]["model"], resumed[0])
        check_update_state_fits(resumed[1], resumed[0], cfg)

    with process_group(backend, env, device, cfg.strategy.timeout_s) if distributed else contextlib.nullcontext():
        return fit(cfg, env, device, gpus, memory_reset, splits, length, model, resumed, run_dir, relaunch)


@record
def evaluate_checkpoint(cfg: DictConfig, env: DistEnv, backend: str, device: torch.device, splits, run_dir: Path) -> dict:
    """mode=eval: the exact metrics of a checkpoint (and of its EMA weights, if any) on data.split, on
    any strategy and world size; written to run_dir/eval.json. Trains nothing and saves no checkpoint.
    The model is built as the checkpoint's config says, so model.* needn't be repeated."""
    split = cfg.data.split
    dataset = splits.test if split == "test" else splits.val
    if dataset is None:
        raise ConfigError(f"data.split=test: this dataset ({cfg.data._target_}) has no test split; use data.split=val")
    path, checkpoint = find_resume_checkpoint(cfg.resume, run_dir, restarted=False)
    model = build_model({**checkpoint["config"]["model"], "weights_path": None}, splits.num_classes, splits.in_channels)
    check_model_accepts(model, dataset[0][0])
    load_model_state(model, checkpoint["model"], path)
    ema = None
    if checkpoint.get("ema") is not None:
        ema = build_ema(model, decay=0.5)  # the decay plays no part in evaluation
        ema.load_state_dict(checkpoint["ema"])
    start_worker_server(dataset, cfg.data.num_workers)
    log.info("evaluating %s (step %d) on the %s split (%d samples), strategy=%s world_size=%d",
             path, checkpoint["global_step"], split, len(dataset), cfg.strategy.name, env.world_size)
    distributed = cfg.strategy.name == "ddp"
    with process_group(backend, env, device, cfg.strategy.timeout_s) if distributed else contextlib.nullcontext():
        model = model.to(device)
        if ema is not None:
            ema = ema.to(device)
        loader = build_val_loader(dataset, cfg.data, env, pin_memory=device.type == "cuda")
        eval_model = wrap_model(model, cfg.strategy, env, device) if cfg.strategy.name == "dp" else model
        metrics = evaluate_with_ema(eval_model, ema, loader, device, cfg.trainer.limit_val_batches)
    results = {
        **{key.replace("val_", f"{split}_", 1): value for key, value in metrics.items()},
        "checkpoint": str(path),
        "step": checkpoint["global_step"],
        "split": split,
        "world_size": env.world_size,
        "strategy": cfg.strategy.name,
    }
    if env.is_main:
        write_json(results, run_dir / "eval.json")
    return results


# What BatchNorm does with syncbn=true outside DDP, where it changes nothing.
SYNCBN_WITHOUT_DDP = {
    "single": "one process, so BatchNorm already sees the whole batch; it applies to strategy=ddp",
    "dp": "DataParallel's replicas each normalise their own chunk of the batch, and the running statistics "
          "come from the first GPU's chunk only; SyncBN does not work under DataParallel (pytorch#38940), "
          "use strategy=ddp syncbn=true to normalise over the whole batch",
}


@record  # a failing rank's traceback reaches torchrun's error summary (Hydra would swallow it)
def fit(cfg: DictConfig, env: DistEnv, device: torch.device, gpus: list[int], memory_reset: bool, splits,
        length: TrainingLength, model, resumed, run_dir: Path, relaunch: str) -> dict:
    world_size, trainer = env.world_size, cfg.trainer
    distributed = cfg.strategy.name == "ddp"
    pin_memory = device.type == "cuda"
    train_loader = build_train_loader(splits.train, cfg.data, env, cfg.seed, pin_memory)
    val_loader = build_val_loader(splits.val, cfg.data, env, pin_memory)

    # memory format and SyncBN before wrapping; the EMA copies the model as it trains
    model = model.to(device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    if cfg.syncbn and distributed:
        model = convert_syncbn(model, device)
    raw_model, ema = model, build_ema(model, cfg.ema.decay)
    # Compiled before wrapping, as timm does (the two orders measured alike on CPU: README, Recipes).
    # Checkpoints hold raw_model's plain keys, never torch.compile's `_orig_mod.` ones.
    trained = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    model = wrap_model(trained, cfg.strategy, env, device)
    compute_timer = ComputeTimer(trained, device)  # this rank's own compute per update: shows a straggler
    slow_down(trained, cfg.fault, env.rank)  # testing aid; after the timer's hook, so the timer counts it
    # DDP's forward may sync buffers, and ranks can hold different numbers of val batches: evaluate
    # the bare, uncompiled model (no eval-mode graph to compile, nor a recompile for a short last
    # batch). DataParallel has no collectives and keeps its multi-GPU eval.
    eval_model = model if cfg.strategy.name == "dp" else raw_model
    # Without SyncBN each rank's BatchNorm statistics drift apart: evaluate rank 0's, the saved ones.
    sync_buffers = distributed and not cfg.syncbn
    lr = scaled_lr(cfg.optim, length.global_batch)
    optimizer = instantiate(optimizer_node(cfg.optim), params=model.parameters(), lr=lr)
    scheduler = build_scheduler(cfg.scheduler, optimizer, length.total_updates, length.updates_per_epoch)
    update = UpdateStep(model, optimizer, device=device, precision=cfg.precision, scheduler=scheduler,
                        clip_norm=trainer.gradient_clip_norm, ema=ema, channels_last=cfg.channels_last,
                        label_smoothing=trainer.label_smoothing,
                        batch_mix=build_batch_mix(cfg.data.mixup_alpha, cfg.data.cutmix_alpha, splits.num_classes))

    torch.manual_seed(cfg.seed + env.rank)  # per-rank randomness (dropout) from here on
    seed_dataparallel_replicas(model, cfg.seed + env.rank)
    random.seed(cfg.seed + env.rank)
    position, rank_state = Position(), None
    if resumed:
        optimizer.load_state_dict(resumed[1]["optimizer"])
        update.load_state_dict(resumed[1])
        resume_schedule(optimizer, scheduler, lr, length.total_updates)  # this run's LR and length apply
        position, rank_state = resume_position(*resumed, cfg.data.batch_size, world_size, env.rank, len(splits.train))
    position.epoch_totals = position.epoch_totals.to(device)

    log.info(
        "strategy=%s world_size=%d device=%s batch_size=%d accumulate=%d global_batch=%d lr=%g precision=%s train=%d val=%d samples",
        cfg.strategy.name, world_size, device, cfg.data.batch_size, length.accumulate, length.global_batch, lr,
        cfg.precision, len(splits.train), len(splits.val),
    )

    meter = ThroughputMeter(trainer.warmup_steps, device)
    recorder = SampleRecorder(cfg.fault.record_samples_dir, env.rank, cfg.data.batch_size) if cfg.fault.record_samples_dir else None

    def save() -> None:
        # A collective: every rank contributes its RNG state, rank 0 writes; never non-finite weights.
        update.check_finite(position.global_step, raw_model)
        rank_states = gather_rank_states(capture_rank_state(train_loader.generator, position.epoch_totals, gpus))
        if env.is_main:
            state = checkpoint_state(raw_model, optimizer, update.state_dict(), position, length.samples_per_batch,
                                     len(splits.train), rank_states, OmegaConf.to_container(cfg, resolve=True))
            save_step_checkpoint(state, run_dir, position.global_step, cfg.checkpoint.keep_last)
        if dist.is_initialized():
            dist.barrier()  # nobody runs ahead (or exits) before the checkpoint exists
        saved["step"] = position.global_step

    def validate_model() -> dict[str, float]:
        if sync_buffers:
            broadcast_buffers_from_rank_zero(raw_model)
            if ema is not None:
                broadcast_buffers_from_rank_zero(ema.module)
        return evaluate_with_ema(eval_model, ema, val_loader, device, trainer.limit_val_batches)

    # loop
    every_n = cfg.checkpoint.every_n_steps
    stopper = StopOnSignal(distributed=dist.is_initialized(), check_every_n_steps=trainer.log_every_n_steps,
                           deadline_s=trainer.stop_deadline_s, requeue_signal=submitit_requeue_signal() if env.launcher == "submitit" else None)
    saved = {"step": position.global_step if resumed else -1}
    progress = tqdm(total=length.total_updates, initial=position.global_step, desc="train",
                    disable=not (env.is_main and sys.stderr.isatty()))

    def after_update(global_samples: int, epoch_ends: bool) -> None:
        progress.update(1)
        meter.step(global_samples)
        compute_timer.update_done()
        inject_fault(cfg.fault, env.rank, position.global_step)
        if position.global_step % trainer.log_every_n_steps == 0 or epoch_ends:  # where the loop waits anyway
            update.check_finite(position.global_step)
        if position.global_step % trainer.log_every_n_steps == 0:
            # each rank's share of the window spent waiting for data, and its compute per update; one
            # all_gather, at log steps only
            per_rank = gather_per_rank([meter.window_data_wait(), compute_timer.window_per_update()], device)
            waits = [rank[0] for rank in per_rank]
            writer.add_scalar("perf/data_wait_fraction", sum(waits) / world_size, position.global_step)
            writer.add_scalar("perf/data_wait_fraction_max", max(waits), position.global_step)
            for name, value in straggler_stats([rank[1] for rank in per_rank]).items():
                writer.add_scalar(f"perf/{name}", value, position.global_step)
        if signum := stopper.stop_now(position.global_step, epoch_ends, device):
            save()
            stopper.saved_step = position.global_step
            interrupted = Interrupted(signum, position.global_step)
            if env.is_main:  # the one line the console shows
                then = "submitit requeues the job, which resumes from it" if stopper.requeue_asked else f"continue with  {relaunch}"
                log.warning("%s (epoch %d); checkpoint saved: %s", interrupted, position.epoch, then)
            else:
                log.info("%s", interrupted)
            stopper.requeue_if_asked()
            raise interrupted
        # At an epoch's last step the save waits for validation, so a resume never repeats it.
        if every_n and position.global_step % every_n == 0 and not epoch_ends:
            meter.pause()
            save()
            meter.resume()

    # stopper: SIGTERM, Ctrl-C and submitit's requeue signal save at the next step boundary, then exit;
    # the writer closes however the run ends
    with stopper, RankZeroWriter(run_dir, env, purge_step=position.global_step + 1 if resumed else None) as writer:
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        while position.epoch < trainer.max_epochs and position.global_step < length.max_steps:
            epoch_started = time.perf_counter()
            start_epoch(train_loader, position.epoch, cfg.seed, env.rank, position.epoch_start)
            # as many as the full epoch, but a resumed epoch that starts part-way may have one fewer
            epoch_batches = min(len(train_loader), length.batches_per_epoch)
            restore = (lambda state=rank_state: restore_rank_state(state, gpus)) if rank_state else None
            batches = meter.timed(iterate_from(train_loader, position.batch_in_epoch, epoch_batches, on_resume=restore))
            rank_state = None
            record_batch = recorder.start_epoch(train_loader.sampler, position.epoch) if recorder else None
            meter.resume()
            train_one_epoch(update, batches, epoch_batches, position, length, trainer.log_every_n_steps, world_size, writer,
                            after_update, record_batch)
            meter.pause()

            loss_sum, count = all_reduce_sum(position.epoch_totals.clone()).tolist()
            metrics = {"train_loss": loss_sum / max(count, 1)}
            writer.add_scalar("train/epoch_loss", metrics["train_loss"], position.global_step)
            writer.add_scalar("train/epoch_time_s", time.perf_counter() - epoch_started, position.global_step)
            last_epoch = position.epoch == trainer.max_epochs - 1 or position.global_step >= length.max_steps
            if (position.epoch + 1) % trainer.val_every_n_epochs == 0 or last_epoch:
                metrics |= validate_model()
                for key, value in metrics.items():
                    if key.startswith("val_") and key != "val_samples":
                        writer.add_scalar(key.replace("val_", "val/", 1), value, position.global_step)
                log.info("epoch %d step %d: %s", position.epoch, position.global_step,
                         " ".join(f"{key}={value:.4f}" for key, value in metrics.items() if key != "val_samples"))
            # A max_steps stop mid-epoch stays where it is (epoch, batch and partial sums), so a longer
            # run resumed from it continues the epoch exactly; validation doesn't touch the RNGs.
            if position.batch_in_epoch >= epoch_batches:
                position.epoch, position.batch_in_epoch, position.epoch_start = position.epoch + 1, 0, 0
                position.epoch_totals = torch.zeros_like(position.epoch_totals)
            if every_n and position.global_step % every_n == 0:
                save()
        progress.close()
        if "val_loss" not in metrics:  # resumed from a finished run: report its metrics again
            metrics |= validate_model()
        wall_s = time.perf_counter() - started

        # save and summarise (rank 0)
        if saved["step"] != position.global_step:
            save()
        writer.add_hparams(hparams_of(cfg, length, lr, world_size), {f"hparam/{k}": v for k, v in metrics.items()}, position.global_step)
    peak_mb, peak_device = peak_memory(gpus, memory_reset)
    compute_timer.window_per_update()  # counts the last window
    # (data wait, peak memory, compute per update) of every rank
    per_rank = gather_per_rank([meter.data_wait_fraction, peak_mb, compute_timer.per_update], device)
    epoch_samples = min(length.samples_per_batch * length.batches_per_epoch, len(splits.train))
    results = {
        **metrics,
        "steps": position.global_step,
        "epochs": position.epoch,  # completed
        "epoch_progress": position.epoch + position.samples_in_epoch(length.samples_per_batch, len(splits.train)) / epoch_samples,
        "world_size": world_size,
        "strategy": cfg.strategy.name,
        "batch_size": cfg.data.batch_size,
        "accumulate_grad_batches": length.accumulate,
        "global_batch_size": length.global_batch,
        "lr": lr,
        "precision": cfg.precision,
        "samples_per_s": meter.samples_per_s,
        "samples_per_s_per_rank": meter.samples_per_s / world_size if meter.samples_per_s else None,
        "data_wait_fraction_per_rank": [rank[0] for rank in per_rank],
        "train_time_s": meter.seconds,
        "wall_s": wall_s,
        "peak_memory_mb": peak_mb,
        "peak_memory_device": peak_device,
        "peak_memory_mb_per_rank": [rank[1] for rank in per_rank],
        "compute_s_per_update_per_rank": [rank[2] for rank in per_rank],
        "straggler_ratio": straggler_stats([rank[2] for rank in per_rank])["straggler_ratio"],
        "replicas_identical": replicas_identical(raw_model, include_buffers=True),
        "bad_samples_skipped": report_skipped_samples(splits, device),  # data.on_bad_sample=skip
    }
    if not results["replicas_identical"]:
        log.warning("the ranks' model replicas differ at the end of training: some code path depends on the rank")
    if env.is_main:
        write_json(results, run_dir / "results.json")
    return results


def hparams_of(cfg: DictConfig, length: TrainingLength, lr: float, world_size: int) -> dict:
    return {
        "strategy": cfg.strategy.name,
        "model": cfg.model.get("name", cfg.model._target_.rsplit(".", 1)[-1]),
        "data": cfg.data._target_.rsplit(".", 1)[-1],
        "optimizer": cfg.optim._target_.rsplit(".", 1)[-1],
        "lr": lr,
        "scheduler": cfg.scheduler.name,
        "precision": cfg.precision,
        "batch_size": cfg.data.batch_size,
        "accumulate_grad_batches": length.accumulate,
        "global_batch_size": length.global_batch,
        "world_size": world_size,
        "syncbn": cfg.syncbn,
        "label_smoothing": cfg.trainer.label_smoothing,
        "mixup_alpha": cfg.data.mixup_alpha,
        "cutmix_alpha": cfg.data.cutmix_alpha,
        "ema_decay": cfg.ema.decay if cfg.ema.decay is not None else 0.0,
        "seed": cfg.seed,
        "max_epochs": cfg.trainer.max_epochs,
    }


register_configs()
register_resolvers()


def drop_traceback(error: BaseException) -> BaseException:
    """`error` without the frames its traceback (and those of the exceptions it chains) holds: they
    hold the failed run's model, optimizer, loaders and tensors, and Hydra and the sweepers keep a
    failed job's exception until the sweep ends, while the next jobs run in this process. Clearing
    the frames' locals is not enough: a frame keeps its function, and fit's closures hold the run."""
    chained, seen = error, set()
    while chained is not None and id(chained) not in seen:  # contexts can form a cycle
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return error


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the final val accuracy: the objective a hyperparameter sweeper maximises."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    env = DistEnv.from_environ()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    relaunch = resume_command(sys.argv[0], list(hydra_cfg.overrides.task), env.local_world_size if env.launched else None, run_dir)
    try:
        if cfg.strategy.name == "ddp" and not env.launched and cfg.strategy.nproc_per_node > 0:
            nproc = cfg.strategy.nproc_per_node
            validate(cfg, launched=True, world_size=nproc)  # fail here, not in N workers
            results = launch_workers(run, cfg, run_dir, relaunch, hydra_cfg.job.name, nproc, cfg.strategy.max_restarts)
        else:
            results = run(cfg, run_dir, relaunch)
    except Interrupted as interrupted:
        record_failed_job(hydra_cfg, cfg, interrupted)  # a sweep stops here: its summary marks the job
        raise drop_traceback(interrupted) if in_sweep else interrupted
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, where no step boundary comes
        record_failed_job(hydra_cfg, cfg, Interrupted(signal.SIGINT))
        sys.stderr.write("error: interrupted before or after training: exiting; nothing more was saved\n")
        sys.exit(130)
    except (ConfigError, Diverged) as error:
        # without the frames that hold it, the run's DataLoader shuts its workers down now, before the line
        drop_traceback(error)
        if in_sweep and not env.launched:
            raise error  # this job fails, the sweep goes on, and its summary says why
        sys.stderr.write(f"error: {error}\n")  # one write: ranks printing at once keep their lines whole
        if in_sweep and env.launcher == "submitit":
            # submitit records the job as failed and the sweep learns why; after an exit it finds no
            # result, and without SLURM accounting (sacct) it would wait for one forever
            raise error
        sys.exit(1)
    except Exception as error:
        if in_sweep and env.launched:
            # Hydra would raise only after the whole batch of jobs, leaving the other ranks waiting in
            # collectives of the next job: end the sweep now (torchrun then stops the other ranks).
            log.exception("sweep job %d (%s) failed; stopping the sweep", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task))
            record_failed_job(hydra_cfg, cfg, error)
            sys.exit(1)
        if in_sweep:  # the traceback goes to this job's log; the sweep goes on without the job's frames
            log.exception("sweep job %d (%s) failed", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task))
            raise drop_traceback(error)
        raise
    if env.is_main:
        log.info("run dir: %s", run_dir)
        log.info("results: %s", {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})
        if cfg.mode == "train":
            log.info("tensorboard: tensorboard --logdir %s  (or: make tensorboard)", run_dir)
    return results["val_accuracy" if "val_accuracy" in results else "test_accuracy"]


if __name__ == "__main__":
    main()
