"""Train an image classifier on one device, with DataParallel, or with DDP under torchrun.

    python train.py                                            # strategy=single
    python train.py strategy=dp                                # DataParallel over visible GPUs
    torchrun --nproc_per_node=2 train.py strategy=ddp syncbn=true
"""

import contextlib
import logging
import resource
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ddp.checkpoint import save_checkpoint
from data import build_datasets
from ddp.config import ConfigError, register_configs, validate
from ddp.env import DistEnv, select_device
from ddp.loaders import build_train_loader, build_val_loader, start_epoch
from ddp.process_group import all_reduce_sum, process_group, replicas_identical, resolve_backend
from ddp.rank_zero import RankZeroWriter, quiet_console_on_other_ranks, write_json
from ddp.run_dir import register_resolvers
from ddp.syncbn import convert_syncbn
from ddp.wrap import unwrap_model, wrap_model

log = logging.getLogger("train")


def train_one_epoch(model, loader, optimizer, device, trainer_cfg, world_size, state, writer, progress) -> None:
    """One pass over this rank's shard; updates `state` (global_step, loss sums, timing) in place."""
    model.train()
    for batch_index, (images, labels) in enumerate(loader):
        if batch_index == trainer_cfg.limit_train_batches or state["global_step"] == trainer_cfg.max_steps:
            break
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        state["global_step"] += 1
        state["loss_sum"] += loss.item() * len(labels)
        state["loss_count"] += len(labels)
        if state["global_step"] == trainer_cfg.warmup_steps:
            state["steady_start"] = time.perf_counter()  # later steps count toward samples/s
        elif state["global_step"] > trainer_cfg.warmup_steps:
            state["steady_samples"] += len(labels) * world_size
        progress.update(1)
        if state["global_step"] % trainer_cfg.log_every_n_steps == 0:
            now = time.perf_counter()
            interval_samples = (state["global_step"] - state["logged_step"]) * len(labels) * world_size
            writer.add_scalar("train/loss", loss.item(), state["global_step"])
            writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], state["global_step"])
            writer.add_scalar("train/samples_per_s", interval_samples / (now - state["logged_at"]), state["global_step"])
            state["logged_step"], state["logged_at"] = state["global_step"], now
            progress.set_postfix(loss=f"{loss.item():.4f}")


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
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").item()
        totals[1] += (logits.argmax(dim=1) == labels).sum().item()
        totals[2] += len(labels)
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_samples": int(count)}


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """The whole run; returns the final metrics (also written to run_dir/results.json on rank 0)."""
    # resolve env and check the config before anything starts or is written
    env = DistEnv.from_environ()
    validate(cfg, under_torchrun=env.under_torchrun, world_size=env.world_size)
    backend = resolve_backend(cfg.backend, torch.cuda.is_available())
    device = select_device(env)
    distributed = cfg.strategy.name == "ddp"
    quiet_console_on_other_ranks(env)
    if cfg.syncbn and not distributed:
        log.warning("syncbn=true has no effect with strategy=%s (one process); it applies to strategy=ddp", cfg.strategy.name)

    # data and model: identical on every rank (same seed)
    torch.manual_seed(cfg.seed)
    splits = build_datasets(cfg.data)
    model = instantiate(cfg.model, num_classes=splits.num_classes, in_channels=splits.in_channels)

    with process_group(backend, env, device, cfg.strategy.timeout_s) if distributed else contextlib.nullcontext():
        return fit(cfg, env, device, splits, model, run_dir)


def fit(cfg: DictConfig, env: DistEnv, device: torch.device, splits, model, run_dir: Path) -> dict:
    world_size = env.world_size
    pin_memory = device.type == "cuda"
    train_loader = build_train_loader(splits.train, cfg.data, env, cfg.seed, pin_memory)
    val_loader = build_val_loader(splits.val, cfg.data, env, pin_memory)

    # SyncBN before wrapping, then wrap
    if cfg.syncbn and cfg.strategy.name == "ddp":
        model = convert_syncbn(model, device)
    model = wrap_model(model.to(device), cfg.strategy, env, device)
    raw_model = unwrap_model(model)
    # DDP's forward may sync buffers; ranks can hold different numbers of val batches, so evaluate
    # the bare model. DataParallel has no collectives and keeps its multi-GPU eval.
    eval_model = raw_model if cfg.strategy.name == "ddp" else model
    optimizer = instantiate(cfg.optim, params=model.parameters())
    torch.manual_seed(cfg.seed + env.rank)  # per-rank randomness (dropout) from here on

    writer = RankZeroWriter(run_dir, env)
    global_batch = cfg.data.batch_size * world_size
    log.info(
        "strategy=%s world_size=%d device=%s batch_size=%d global_batch=%d train=%d val=%d samples",
        cfg.strategy.name, world_size, device, cfg.data.batch_size, global_batch, len(splits.train), len(splits.val),
    )

    # loop
    trainer = cfg.trainer
    started = time.perf_counter()
    state = {"global_step": 0, "steady_samples": 0, "steady_start": started, "logged_step": 0, "logged_at": started}
    metrics: dict[str, float] = {}
    steps_per_epoch = len(train_loader) if trainer.limit_train_batches == -1 else min(len(train_loader), trainer.limit_train_batches)
    total_steps = steps_per_epoch * trainer.max_epochs
    if trainer.max_steps != -1:
        total_steps = min(total_steps, trainer.max_steps)
    progress = tqdm(total=total_steps, desc="train", disable=not (env.is_main and sys.stderr.isatty()))
    for epoch in range(trainer.max_epochs):
        if state["global_step"] == trainer.max_steps:
            break
        epoch_started = time.perf_counter()
        start_epoch(train_loader, epoch, cfg.seed, env.rank)
        state["loss_sum"], state["loss_count"] = 0.0, 0
        train_one_epoch(model, train_loader, optimizer, device, trainer, world_size, state, writer, progress)
        loss_sum, loss_count = all_reduce_sum(torch.tensor([state["loss_sum"], state["loss_count"]], dtype=torch.float64, device=device)).tolist()
        metrics = {"train_loss": loss_sum / max(loss_count, 1)}
        writer.add_scalar("train/epoch_loss", metrics["train_loss"], state["global_step"])
        writer.add_scalar("train/epoch_time_s", time.perf_counter() - epoch_started, state["global_step"])
        last_epoch = epoch == trainer.max_epochs - 1 or state["global_step"] == trainer.max_steps
        if (epoch + 1) % trainer.val_every_n_epochs == 0 or last_epoch:
            metrics |= evaluate(eval_model, val_loader, device, trainer.limit_val_batches)
            writer.add_scalar("val/loss", metrics["val_loss"], state["global_step"])
            writer.add_scalar("val/accuracy", metrics["val_accuracy"], state["global_step"])
            log.info("epoch %d step %d: train_loss=%.4f val_loss=%.4f val_accuracy=%.4f", epoch, state["global_step"],
                     metrics["train_loss"], metrics["val_loss"], metrics["val_accuracy"])
    progress.close()
    wall_s = time.perf_counter() - started
    steady_s = time.perf_counter() - state["steady_start"]

    # save and summarise (rank 0)
    results = {
        **metrics,
        "steps": state["global_step"],
        "epochs": epoch + 1,
        "world_size": world_size,
        "strategy": cfg.strategy.name,
        "batch_size": cfg.data.batch_size,
        "global_batch_size": global_batch,
        "samples_per_s": state["steady_samples"] / steady_s if state["steady_samples"] else None,
        "wall_s": wall_s,
        "peak_memory_mb": peak_memory_mb(device),
        "replicas_identical": replicas_identical(raw_model),
    }
    if not results["replicas_identical"]:
        log.warning("the ranks' model replicas differ at the end of training: some code path depends on the rank")
    if env.is_main:
        save_checkpoint(
            {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "global_step": state["global_step"],
                "config": OmegaConf.to_container(cfg, resolve=True),
            },
            run_dir / "checkpoints" / "last.pt",
        )
        write_json(results, run_dir / "results.json")
    writer.add_hparams(hparams_of(cfg, world_size), {f"hparam/{k}": v for k, v in metrics.items()}, state["global_step"])
    writer.close()
    return results


def hparams_of(cfg: DictConfig, world_size: int) -> dict:
    return {
        "strategy": cfg.strategy.name,
        "model": cfg.model._target_.rsplit(".", 1)[-1],
        "data": cfg.data._target_.rsplit(".", 1)[-1],
        "optimizer": cfg.optim._target_.rsplit(".", 1)[-1],
        "lr": cfg.optim.lr,
        "batch_size": cfg.data.batch_size,
        "global_batch_size": cfg.data.batch_size * world_size,
        "world_size": world_size,
        "syncbn": cfg.syncbn,
        "seed": cfg.seed,
        "max_epochs": cfg.trainer.max_epochs,
    }


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        results = run(cfg, run_dir)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    if DistEnv.from_environ().is_main:
        log.info("run dir: %s", run_dir)
        log.info("results: %s", {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})
        log.info("tensorboard: tensorboard --logdir %s  (or: make tensorboard)", run_dir)
    return results


if __name__ == "__main__":
    main()
