"""Exact evaluation: every sample of a split counted once across ranks, then one all_reduce of the
task's sums (tasks/__init__.py). Used by training's validation and by mode=eval."""

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp.checkpoints.checkpoint import CheckpointError
from ddp.checkpoints.resume import find_resume_checkpoint, load_model_state
from ddp.config.checks import check_model_accepts
from ddp.config.schema import MULTI_PROCESS, ConfigError
from ddp.distributed.dtensor import is_sharded
from ddp.distributed.env import DistEnv
from ddp.distributed.process_group import all_reduce_sum, broadcast_buffers_from_rank_zero, process_group
from ddp.distributed.wrap import wrap_model
from ddp.loading.loader_workers import start_worker_server
from ddp.loading.loaders import build_val_loader
from ddp.loading.samplers import shard_indices
from ddp.reporting.rank_zero import write_json
from ddp.training.ema import build_ema

log = logging.getLogger("train")  # the run's own console lines, under the script's name


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, limit_batches: int, task) -> dict[str, float]:
    """The task's metrics over the loader's split (all of it, across ranks), keys prefixed "val_"."""
    model.eval()
    sums, forwards = None, 0
    for batch_index, (images, targets) in enumerate(loader):
        if batch_index == limit_batches:
            break
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        batch_sums = task.eval_sums(model(images), targets)
        sums = batch_sums if sums is None else sums.add_(batch_sums)
        forwards += 1
    if sums is None or is_sharded(model):
        images, targets = (tensor.to(device) for tensor in loader.collate_fn([loader.dataset[0]]))
    if sums is None:  # this rank's shard is empty: zeros, as long as the other ranks' sums
        sums = torch.zeros_like(task.eval_sums(model(images), targets))
        forwards += 1
    if is_sharded(model):
        # Every forward of a sharded model is a collective (FSDP gathers each block's parameters), and
        # shards differ by a batch: a rank with fewer runs forwards that count for nothing, up to the
        # count every rank knows without asking (a collective here would meet another rank's forward).
        most = most_val_forwards(len(loader.dataset), dist.get_world_size(), loader.batch_size, limit_batches)
        for _ in range(most - forwards):
            model(images)
    return {"val_" + key: value for key, value in task.metrics(all_reduce_sum(sums)).items()}


def most_val_forwards(size: int, world_size: int, batch_size: int, limit_batches: int) -> int:
    """The most forwards any rank runs in `evaluate` over `size` samples: rank 0's batches, its shard
    (shard_indices) being the largest, cut at `limit_batches` (-1: none); at least 1, as many as an
    empty shard's one zero batch. A pure function of the sizes, so every rank computes the same."""
    batches = math.ceil(len(shard_indices(size, world_size, 0)) / batch_size)
    return batches if limit_batches == -1 else min(batches, limit_batches)


def evaluate_with_ema(model: nn.Module, ema, loader, device: torch.device, limit_batches: int, task) -> dict[str, float]:
    """`evaluate`, and the EMA weights' metrics too (as val_ema_*, without their sample count) when there are any."""
    metrics = evaluate(model, loader, device, limit_batches, task)
    if ema is not None:
        ema_metrics = evaluate(ema.module, loader, device, limit_batches, task)
        metrics |= {key.replace("val_", "val_ema_", 1): value for key, value in ema_metrics.items() if key != "val_samples"}
    return metrics


class Validator:
    """Validation during training, of the model the checkpoint saves (and of its EMA weights)."""

    def __init__(self, model: nn.Module, raw_model: nn.Module, ema, loader, device: torch.device, limit_batches: int,
                 task, *, strategy: str, syncbn: bool):
        # DDP's forward may sync buffers, and ranks can hold different numbers of val batches: evaluate
        # the bare, uncompiled model (no eval-mode graph to compile, nor a recompile for a short last
        # batch). DataParallel has no collectives and keeps its multi-GPU eval. Under FSDP the bare
        # model is the sharded one (`evaluate` keeps its ranks in step).
        self.eval_model = model if strategy == "dp" else raw_model
        self.raw_model, self.ema, self.loader = raw_model, ema, loader
        self.device, self.limit_batches, self.task = device, limit_batches, task
        # Without SyncBN each rank's BatchNorm statistics drift apart: evaluate rank 0's, the saved ones.
        self.sync_buffers = strategy in MULTI_PROCESS and not syncbn

    def validate(self) -> dict[str, float]:
        if self.sync_buffers:
            broadcast_buffers_from_rank_zero(self.raw_model)
            if self.ema is not None:
                broadcast_buffers_from_rank_zero(self.ema.module)
        return evaluate_with_ema(self.eval_model, self.ema, self.loader, self.device, self.limit_batches, self.task)

    def log_extras(self, writer, step: int) -> None:
        """The task's TensorBoard extras, of the bare model as just evaluated."""
        self.task.log_validation(writer, self.raw_model, self.loader.dataset, self.device, step)


@record
def evaluate_checkpoint(cfg: DictConfig, env: DistEnv, backend: str, device: torch.device, splits, task, run_dir: Path,
                        build_model: Callable[..., nn.Module]) -> dict:
    """mode=eval: the exact metrics of a checkpoint (and of its EMA weights, if any) on data.split, on
    any strategy and world size; written to run_dir/eval.json. Trains nothing and saves no checkpoint.
    The model is built (`build_model`) as the checkpoint's config says, so model.* needn't be repeated."""
    split = cfg.data.split
    dataset = splits.test if split == "test" else splits.val
    if dataset is None:
        raise ConfigError(f"data.split=test: this dataset ({cfg.data._target_}) has no test split; use data.split=val")
    path, checkpoint = find_resume_checkpoint(cfg.resume, run_dir, restarted=False)
    state = checkpoint.get("model")
    if checkpoint.get("sharded"):  # strategy=fsdp's reads back whole, so any strategy and world size evaluates it
        from ddp.checkpoints.sharded_checkpoint import full_model_state  # DCP, imported where it's used (ddp/distributed/fsdp.py)

        try:
            state = full_model_state(path)
        except CheckpointError as error:
            raise ConfigError(f"resume={cfg.resume}: {error}") from None
    model = build_model({**checkpoint["config"]["model"], "weights_path": None}, splits.num_classes, splits.in_channels)
    check_model_accepts(model, dataset[0][0])
    load_model_state(model, state, path)
    ema = None
    if checkpoint.get("ema") is not None:
        ema = build_ema(model, decay=0.5)  # the decay plays no part in evaluation
        ema.load_state_dict(checkpoint["ema"])
    start_worker_server(dataset, cfg.data.num_workers)
    log.info("evaluating %s (step %d) on the %s split (%d samples), strategy=%s world_size=%d",
             path, checkpoint["global_step"], split, len(dataset), cfg.strategy.name, env.world_size)
    distributed = cfg.strategy.name in MULTI_PROCESS
    with process_group(backend, env, device, cfg.strategy.timeout_s) if distributed else contextlib.nullcontext():
        model = model.to(device)
        if ema is not None:
            ema = ema.to(device)
        loader = build_val_loader(dataset, cfg.data, env, pin_memory=device.type == "cuda")
        eval_model = wrap_model(model, cfg.strategy, env, device, cfg.precision) if cfg.strategy.name == "dp" else model
        metrics = evaluate_with_ema(eval_model, ema, loader, device, cfg.trainer.limit_val_batches, task)
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
