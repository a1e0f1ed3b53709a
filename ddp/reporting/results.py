"""What a training run reports: results.json's figures, and the hparams of TensorBoard's HParams table."""

import logging
from pathlib import Path

from omegaconf import DictConfig

from ddp.distributed.env import DistEnv
from ddp.reporting.rank_zero import write_json
from ddp.reporting.trackers import where_to_look
from ddp.run_context import RunContext
from ddp.training.progress import Position

log = logging.getLogger("train")  # the run's own console lines, under the script's name


def training_results(ctx: RunContext, metrics: dict[str, float], best_results: dict, position: Position, length, lr: float,
                     performance: dict) -> dict:
    """results.json: the final metrics, the best validation's (BestTracker.results: best_step, best_<metric>,
    stopped_early), how far the run got, its settings, and `performance` (RunMonitor's); train.py adds
    the end-of-run checks after them."""
    cfg, world_size = ctx.cfg, ctx.env.world_size
    epoch_samples = min(length.samples_per_batch * length.batches_per_epoch, length.train_size)
    return {
        **metrics,
        **best_results,
        "steps": position.global_step,
        "epochs": position.epoch,  # completed
        "epoch_progress": position.epoch + position.samples_in_epoch(length.samples_per_batch, length.train_size) / epoch_samples,
        "world_size": world_size,
        "strategy": cfg.strategy.name,
        "batch_size": cfg.data.batch_size,
        "accumulate_grad_batches": length.accumulate,
        "global_batch_size": length.global_batch,
        "lr": lr,
        "precision": cfg.precision,
        **performance,
    }


def log_setup(cfg: DictConfig, world_size: int, device, length, lr: float, val_size: int,
              baselines: dict[str, float]) -> None:
    """The run's settings, and its task's baselines' metrics (Task.baselines: a teacher's), if any."""
    log.info("strategy=%s world_size=%d device=%s batch_size=%d accumulate=%d global_batch=%d lr=%g precision=%s train=%d "
             "val=%d samples", cfg.strategy.name, world_size, device, cfg.data.batch_size, length.accumulate,
             length.global_batch, lr, cfg.precision, length.train_size, val_size)
    if baselines:
        log.info("baselines: %s", " ".join(f"{key}={value:.4f}" for key, value in baselines.items()))


def write_results(results: dict, run_dir: Path, env: DistEnv) -> None:
    """run_dir/results.json, by rank 0."""
    if not results["replicas_identical"]:
        log.warning("the ranks' model replicas differ at the end of training: some code path depends on the rank")
    if env.is_main:
        write_json(results, run_dir / "results.json")


def log_results(results: dict, run_dir: Path, mode: str, logger_cfg: DictConfig) -> None:
    """The console's last lines (rank 0): the run dir, its results, and where each logger shows it."""
    log.info("run dir: %s", run_dir)
    log.info("results: %s", {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})
    if mode == "train":
        for line in where_to_look(logger_cfg, run_dir):
            log.info("%s", line)


def log_hparams(writer, cfg: DictConfig, length, lr: float, world_size: int, metrics: dict[str, float], step: int) -> None:
    """The run's row of TensorBoard's HParams table, with its final metrics as hparam/<metric>."""
    writer.add_hparams(hparams_of(cfg, length, lr, world_size), {f"hparam/{k}": v for k, v in metrics.items()}, step)


def hparams_of(cfg: DictConfig, length, lr: float, world_size: int) -> dict:
    """The run's row of TensorBoard's HParams table."""
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
