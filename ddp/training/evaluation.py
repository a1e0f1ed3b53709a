"""Exact evaluation: every sample of a split counted once across ranks, then one all_reduce of the
task's sums (tasks/__init__.py), or, for a task that gathers its predictions (detection), every
rank's per-sample records gathered to rank 0, checked to hold each evaluated sample once, and scored
there once. Used by training's validation and by mode=eval (evaluate.py)."""


import torch
import torch.distributed as dist
from torch import nn

from ddp.distributed.dtensor import is_sharded
from ddp.distributed.process_group import all_reduce_sum, broadcast_buffers_from_rank_zero, on_rank_zero
from ddp.loading.batches import one_sample_batch, to_device
from ddp.loading.samplers import most_shard_batches, samples_in_shards
from ddp.run_context import RunContext


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, limit_batches: int, task) -> dict[str, float]:
    """The task's metrics over the loader's split (all of it, across ranks), keys prefixed "val_"."""
    model.eval()
    sums, forwards, records = None, 0, []
    for batch_index, batch in enumerate(loader):
        if batch_index == limit_batches:
            break
        batch_sums = task.eval_step(model, to_device(batch, device, normalization=getattr(loader.dataset, "image_normalization", None)))
        if task.gathers_predictions:
            batch_sums, batch_records = batch_sums
            records += batch_records
        sums = batch_sums if sums is None else sums.add_(batch_sums)
        forwards += 1
    if sums is None or is_sharded(model):
        batch = to_device(one_sample_batch(loader.dataset), device)
    if sums is None:  # this rank's shard is empty: zeros, as long as the other ranks' sums
        sums = task.eval_step(model, batch)
        sums = torch.zeros_like(sums[0] if task.gathers_predictions else sums)
        forwards += 1
    if is_sharded(model):
        # Every forward of a sharded model is a collective (FSDP gathers each block's parameters), and
        # shards differ by a batch: a rank with fewer runs steps that count for nothing, up to the
        # count every rank knows without asking (a collective here would meet another rank's forward).
        most = most_shard_batches(len(loader.dataset), dist.get_world_size(), loader.batch_size, limit_batches)
        for _ in range(most - forwards):
            task.eval_step(model, batch)
    sums = all_reduce_sum(sums)
    if task.gathers_predictions:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        evaluated = samples_in_shards(len(loader.dataset), world_size, loader.batch_size, limit_batches)
        metrics = on_rank_zero(gathered_metrics, records, task, sums, loader.dataset.dataset, evaluated)
    else:
        metrics = task.metrics(sums)
    return {"val_" + key: value for key, value in metrics.items()}


class IncompleteEvaluation(RuntimeError):
    """A gathering task's records don't hold each evaluated sample once: a sample missing or counted twice."""


def gathered_metrics(every_rank_records: list[list[dict]], task, sums: torch.Tensor, dataset, evaluated: int) -> dict[str, float]:
    """On rank 0: the task's metrics of all ranks' records, once each sample of the `evaluated` ones is
    there exactly once (by its record's `id`); else IncompleteEvaluation naming what is wrong."""
    records = [record for rank_records in every_rank_records for record in rank_records]
    ids = [record["id"] for record in records]
    repeated = sorted({sample_id for sample_id in ids if ids.count(sample_id) > 1}) if len(set(ids)) < len(ids) else []
    if repeated or len(ids) != evaluated:
        raise IncompleteEvaluation(f"evaluation: {len(set(ids))} distinct samples have predictions, of the {evaluated} evaluated"
                                   f"{f'; counted more than once: {repeated[:10]}' if repeated else ''}; a sample's "
                                   "predictions were lost or repeated, so no metric is reported")
    return task.metrics(sums, records, dataset)


def evaluate_with_ema(model: nn.Module, ema, loader, device: torch.device, limit_batches: int, task) -> dict[str, float]:
    """`evaluate`, and the EMA weights' metrics too (as val_ema_*, without their sample count) when there are any."""
    metrics = evaluate(model, loader, device, limit_batches, task)
    if ema is not None:
        ema_metrics = evaluate(ema.module, loader, device, limit_batches, task)
        metrics |= {key.replace("val_", "val_ema_", 1): value for key, value in ema_metrics.items() if key != "val_samples"}
    return metrics


class Validator:
    """Validation during training, of the model the checkpoint saves (and of its EMA weights)."""

    def __init__(self, ctx: RunContext, model: nn.Module, raw_model: nn.Module, ema, loader, task):
        strategy = ctx.cfg.strategy.name
        # DDP's forward may sync buffers, and ranks can hold different numbers of val batches: evaluate
        # the bare, uncompiled model (no eval-mode graph to compile, nor a recompile for a short last
        # batch). DataParallel has no collectives and keeps its multi-GPU eval. Under FSDP the bare
        # model is the sharded one (`evaluate` keeps its ranks in step).
        self.eval_model = model if strategy == "dp" else raw_model
        self.raw_model, self.ema, self.loader = raw_model, ema, loader
        self.device, self.limit_batches, self.task = ctx.device, ctx.cfg.trainer.limit_val_batches, task
        # Without SyncBN each rank's BatchNorm statistics drift apart: evaluate rank 0's, the saved ones.
        self.sync_buffers = ctx.distributed and not ctx.cfg.syncbn

    def validate(self) -> dict[str, float]:
        if self.sync_buffers:
            broadcast_buffers_from_rank_zero(self.raw_model)
            if self.ema is not None:
                broadcast_buffers_from_rank_zero(self.ema.module)
        return evaluate_with_ema(self.eval_model, self.ema, self.loader, self.device, self.limit_batches, self.task)

    def validate_baselines(self) -> dict[str, float]:
        """The task's baselines (a teacher), evaluated like the model: <name>_val_<metric>, without sample counts."""
        return {f"{name}_{key}": value for name, module in self.task.baselines().items()
                for key, value in evaluate(module, self.loader, self.device, self.limit_batches, self.task).items()
                if key != "val_samples"}

    def log_extras(self, writer, step: int) -> None:
        """The task's TensorBoard extras, of the bare model as just evaluated."""
        self.task.log_validation(writer, self.raw_model, self.loader.dataset, self.device, step)
