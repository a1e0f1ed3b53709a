"""mode=eval, the second recipe: `python train.py mode=eval resume=<run dir or checkpoint>` runs
`evaluate_checkpoint` (train.py's `run` hands over once the process is set up): a checkpoint's exact
metrics on data.split, on any strategy and world size. Training's recipe is train.py."""

import contextlib
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.distributed.elastic.multiprocessing.errors import record

from data import build_datasets

from ddp.checkpoints.checkpoint import CheckpointError
from ddp.checkpoints.resume import find_resume_checkpoint, load_model_state, state_misfit
from ddp.config.checks import check_model_accepts
from ddp.config.schema import ConfigError, TaskConfig
from ddp.distributed.process_group import process_group
from ddp.jobs.failures import startup_passed
from ddp.loading.batches import sample_image
from ddp.loading.loader_workers import start_worker_server
from ddp.loading.loaders import build_val_loader
from ddp.reporting.rank_zero import write_json
from ddp.run_context import RunContext
from ddp.training.ema import build_ema
from ddp.training.evaluation import evaluate_with_ema
from ddp.training.wrap import wrap_model
from models import build_model
from tasks import build_task

log = logging.getLogger("train")  # the run's own console lines, under the script's name
# The checkpoint use_checkpoint_task read, by (resume, run dir), for evaluate_checkpoint to take: read and verified once
_read: dict[tuple[str, Path], tuple[Path, dict]] = {}


def eval_startup(cfg: DictConfig) -> tuple:
    """(splits, task): mode=eval's data and task, built as train.py's check_startup builds training's, before any
    process group; main runs it in a self-launching process too. Nothing trains, so there are no data.views to check:
    evaluation's samples are one view each."""
    torch.manual_seed(cfg.seed)  # data and task: identical on every rank (same seed)
    splits = build_datasets(cfg.data)
    return splits, build_task(cfg.task, splits.num_classes, splits.class_names, splits.in_channels, views=None)


@record
def evaluate_checkpoint(ctx: RunContext) -> dict:
    """mode=eval: the exact metrics of a checkpoint (and of its EMA weights, if any) on data.split, on
    any strategy and world size; written to run_dir/eval.json. Trains nothing and saves no checkpoint.
    The model is built as the checkpoint's config says, so model.* needn't be repeated; the task is the
    checkpoint's too, unless the command line named one (use_checkpoint_task)."""
    cfg, env, device, run_dir = ctx.cfg, ctx.env, ctx.device, ctx.run_dir
    splits, task = eval_startup(cfg)
    split = cfg.data.split
    dataset = splits.test if split == "test" else splits.val
    if dataset is None:
        raise ConfigError(f"data.split=test: this dataset ({cfg.data._target_}) has no test split; use data.split=val")
    path, checkpoint = _read.pop((cfg.resume, run_dir), None) or find_resume_checkpoint(cfg.resume, run_dir, restarted=False)
    state = checkpoint.get("model")
    if checkpoint.get("sharded"):  # strategy=fsdp's reads back whole, so any strategy and world size evaluates it
        from ddp.checkpoints.sharded_checkpoint import full_model_state  # DCP, imported where it's used (ddp/distributed/fsdp.py)

        try:
            state = full_model_state(path)
        except CheckpointError as error:
            raise ConfigError(f"resume={cfg.resume}: {error}") from None
    model = build_model({**checkpoint["config"]["model"], "weights_path": None}, splits.num_classes, splits.in_channels,
                        with_heads=task.with_heads)
    check_model_accepts(model, sample_image(dataset[0]))
    check_task_fits(model, state, path, OmegaConf.to_container(cfg.task, resolve=True), checkpoint["config"].get("task"))
    load_model_state(model, state, path)
    ema = None
    if checkpoint.get("ema") is not None:
        ema = build_ema(model, decay=0.5)  # the decay plays no part in evaluation
        ema.load_state_dict(checkpoint["ema"])
    start_worker_server(dataset, cfg.data.num_workers)
    startup_passed(run_dir)  # as train.py's check_startup: mode=eval's checks are behind
    log.info("evaluating %s (step %d) with task %s on the %s split (%d samples), strategy=%s world_size=%d",
             path, checkpoint["global_step"], cfg.task._target_, split, len(dataset), cfg.strategy.name, env.world_size)
    with process_group(ctx.backend, env, device, cfg.strategy.timeout_s) if ctx.distributed else contextlib.nullcontext():
        model = model.to(device)
        if ema is not None:
            ema = ema.to(device)
        loader = build_val_loader(dataset, cfg.data, env, pin_memory=ctx.pin_memory)
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


def use_checkpoint_task(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """mode=eval: cfg.task becomes the task of the checkpoint that `resume` names, as its model does (its config's),
    unless the command line's `overrides` name a task (task=..., task.<key>=...): a task's heads are part of the model
    it trained, and every stage after this one (check_startup, the objective main returns) reads cfg.task. The
    checkpoint read is kept for evaluate_checkpoint (a sweep's next job drops one its job didn't take)."""
    _read.clear()
    if cfg.mode != "eval" or cfg.resume in (None, "auto"):
        return  # training, or a resume that validate refuses in one line
    if any(override.split("=", 1)[0].lstrip("+~").split(".", 1)[0] == "task" for override in overrides):
        return
    try:
        found = find_resume_checkpoint(cfg.resume, run_dir, restarted=False)
    except ConfigError:
        return  # refused in one line where evaluate_checkpoint loads it, after the checks before it
    _read[cfg.resume, run_dir] = found
    trained_with = found[1]["config"].get("task")
    if trained_with is not None:  # None: saved before tasks existed, when every run classified
        with open_dict(cfg):  # the task's options are its builder's (ddp/config/builder_options.py), not TaskConfig's
            cfg.task = OmegaConf.merge(OmegaConf.structured(TaskConfig, flags={"struct": False}), trained_with)


def check_task_fits(model, state: dict, path: Path, task: dict, trained_with: dict | None) -> None:
    """The model is the checkpoint's (its config's model.*), so where its weights don't fit another task than the
    checkpoint's, the task's heads (Task.with_heads) are what differ: the line names the task's keys that differ
    (its _target_, else its options), the keys to change. load_model_state reports any other misfit."""
    misfit = state_misfit(model, {key: value.shape for key, value in state.items()})
    if not misfit or trained_with is None or task == trained_with:
        return
    differ = ["_target_"] if task["_target_"] != trained_with["_target_"] else sorted(
        key for key in task.keys() | trained_with.keys() if task.get(key) != trained_with.get(key))
    given, trained = (", ".join(f"task.{key}={values.get(key)}" for key in differ) for values in (task, trained_with))
    raise ConfigError(f"{given}: {path} was trained with {trained}, whose heads this task's model doesn't match ({misfit}); "
                      "drop task= and task.* to evaluate it with the task it was trained with")
