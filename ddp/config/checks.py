"""The startup checks that a schema's types can't express: a composed config's values (`validate`)
and the model against the data's samples (`check_model_accepts`). Each failure is a one-line
ConfigError naming the key and the fix, raised before anything is started or written."""

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ddp.config.builder_options import builder_options
from ddp.config.schema import ACTIVATION_CHECKPOINTING, BUILDERS, MULTI_PROCESS, SHARDED, ConfigError

log = logging.getLogger(__name__)


def check_model_accepts(model: torch.nn.Module, image: torch.Tensor) -> None:
    """One dataset sample's image (ddp/loading/batches.py: sample_image) through the model in eval mode,
    so data the model can't take (an image too small for its pooling, the wrong channel count) stops the
    run now, as a one-line error."""
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(image.unsqueeze(0))
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"data/model: the model can't take this data's samples (shape {list(image.shape)}): "
                          f"{reason}; check data.image_size / data.channels against model.*") from None
    finally:
        model.train(was_training)


STRATEGIES = ("single", "dp", "ddp", "fsdp", "hsdp")
MODES = ("train", "eval")
SPLITS = ("val", "test")
PRECISIONS = ("32", "bf16", "16")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LR_SCALINGS = ("none", "linear", "sqrt")
# DDP ranks act on SIGTERM at log steps; this many steps must fit in trainer.stop_deadline_s.
MAX_LOG_EVERY_N_STEPS = 100
BACKENDS = ("auto", "nccl", "gloo")
DIRECTIONS = ("maximize", "minimize")
OBJECTIVES = ("final", "best")
BEST_OF = ("model", "ema")
# What BatchNorm does with syncbn=true outside DDP, where it changes nothing: validate warns.
SYNCBN_WITHOUT_DDP = {
    "single": "one process, so BatchNorm already sees the whole batch; it applies to strategy=ddp",
    "dp": "DataParallel's replicas each normalise their own chunk of the batch, and the running statistics "
          "come from the first GPU's chunk only; SyncBN does not work under DataParallel (pytorch#38940), "
          "use strategy=ddp syncbn=true to normalise over the whole batch",
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys that no schema declares. Hydra lets `+key=value` add them even to structured configs.
    The BUILDERS groups' keys are builder_options' to check."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set(node)
    unknown = [prefix + str(key) for key in node if key not in known]
    for key in known & set(node):
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and f"{prefix}{key}" not in BUILDERS:
            unknown += _unknown_keys(child, f"{prefix}{key}.")
    return unknown


def validate(cfg: Any, *, launched: bool, world_size: int) -> None:
    """Check what the schema's types can't, before anything is started or written; warn of a setting that changes nothing."""
    for key in _unknown_keys(cfg):
        raise ConfigError(f"{key}: unknown key; check the spelling (`python train.py --cfg job` lists the keys)")
    for group in BUILDERS:
        builder_options(cfg[group], group)
    for key in sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(f"{key} is required: pass {key}=<value> on the command line")
    strategy = cfg.strategy.name
    _check(strategy in STRATEGIES, f"strategy.name={strategy}: unknown, use one of {', '.join(STRATEGIES)}")
    if cfg.devices is not None:
        devices = list(cfg.devices)
        _check(len(devices) > 0 and min(devices) >= 0 and len(set(devices)) == len(devices),
               f"devices={devices}: list distinct GPU indices >= 0 (e.g. devices=[0,2]), or devices=null for all visible GPUs")
    _check(cfg.backend in BACKENDS, f"backend={cfg.backend}: unknown, use one of {', '.join(BACKENDS)}")
    _check(cfg.data.batch_size > 0, f"data.batch_size={cfg.data.batch_size}: must be > 0 (it is per process), e.g. data.batch_size=32")
    _check(cfg.data.num_workers >= 0, f"data.num_workers={cfg.data.num_workers}: must be >= 0")
    _check(cfg.data.shuffle_window >= 0, f"data.shuffle_window={cfg.data.shuffle_window}: must be >= 0 (0: one shuffle of "
                                         "all samples; K: K shards at a time)")
    groups = cfg.data.aspect_ratio_groups
    _check(groups >= 0, f"data.aspect_ratio_groups={groups}: must be >= 0 (0: off; K: 2K+2 aspect ratio groups, e.g. 3)")
    _check(not (groups and cfg.data.shuffle_window), f"data.aspect_ratio_groups={groups}: can't go with data.shuffle_window="
           f"{cfg.data.shuffle_window}, whose reads stay within its shards while a group's batch gathers images from any; "
           "set one of them to 0")
    if cfg.data.val_batch_size is not None:
        _check(cfg.data.val_batch_size > 0, f"data.val_batch_size={cfg.data.val_batch_size}: must be > 0, e.g. 1")
    _check(cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr}: must be > 0, e.g. optim.lr=0.01")
    if "momentum" in cfg.optim:  # torch accepts any momentum >= 0; from 1 on, updates grow without bound
        momentum = cfg.optim.momentum
        _check(0 <= momentum < 1, f"optim.momentum={momentum}: must be in [0, 1), e.g. optim.momentum=0.9")
    _check(cfg.strategy.timeout_s > 0, f"strategy.timeout_s={cfg.strategy.timeout_s}: must be > 0")
    trainer = cfg.trainer
    _check(trainer.max_epochs >= 1, f"trainer.max_epochs={trainer.max_epochs}: must be >= 1")
    for key in ("max_steps", "limit_train_batches", "limit_val_batches"):
        value = trainer[key]
        _check(value == -1 or value >= 1, f"trainer.{key}={value}: must be -1 (no limit) or >= 1")
    for key in ("log_every_n_steps", "val_every_n_epochs"):
        _check(trainer[key] >= 1, f"trainer.{key}={trainer[key]}: must be >= 1")
    _check(
        trainer.log_every_n_steps <= MAX_LOG_EVERY_N_STEPS,
        f"trainer.log_every_n_steps={trainer.log_every_n_steps}: must be <= {MAX_LOG_EVERY_N_STEPS} (DDP ranks check "
        "for SIGTERM at log steps, and must reach one within trainer.stop_deadline_s of it)",
    )
    _check(trainer.stop_deadline_s > 0, f"trainer.stop_deadline_s={trainer.stop_deadline_s}: must be > 0")
    _check(trainer.warmup_steps >= 0, f"trainer.warmup_steps={trainer.warmup_steps}: must be >= 0")
    _check(cfg.checkpoint.every_n_steps >= 0, f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps}: must be >= 0 (0: only at the end)")
    _check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 1")
    _check(cfg.checkpoint.keep_best >= 0, f"checkpoint.keep_best={cfg.checkpoint.keep_best}: must be >= 0 (0: off)")
    _check(cfg.checkpoint.best_of in BEST_OF, f"checkpoint.best_of={cfg.checkpoint.best_of}: unknown, use one of {', '.join(BEST_OF)}")
    _check(cfg.checkpoint.best_of != "ema" or cfg.ema.decay is not None,
           "checkpoint.best_of=ema ranks by the EMA weights' metric, but there are none: set ema.decay (e.g. 0.999) or checkpoint.best_of=model")
    _check(trainer.objective in OBJECTIVES, f"trainer.objective={trainer.objective}: unknown, use one of {', '.join(OBJECTIVES)}")
    patience = trainer.early_stop_patience
    _check(patience is None or patience >= 1, f"trainer.early_stop_patience={patience}: must be >= 1, or null for no early stopping")
    _check(trainer.early_stop_min_delta >= 0, f"trainer.early_stop_min_delta={trainer.early_stop_min_delta}: must be >= 0")
    for key in ("kill_rank", "raise_rank", "stall_rank"):
        rank = cfg.fault[key]
        _check(rank < world_size, f"fault.{key}={rank}: there are only {world_size} ranks")
        _check(rank < 0 or cfg.fault.at_step >= 1, f"fault.{key}={rank} needs fault.at_step >= 1")
    _check(cfg.fault.slow_rank < world_size, f"fault.slow_rank={cfg.fault.slow_rank}: there are only {world_size} ranks")
    _check(cfg.fault.slow_rank < 0 or cfg.fault.slow_ms > 0, f"fault.slow_rank={cfg.fault.slow_rank} needs fault.slow_ms > 0")
    _check(cfg.fault.slow_val_ms >= 0, f"fault.slow_val_ms={cfg.fault.slow_val_ms}: must be >= 0")
    _check(not cfg.fault.plan or Path(cfg.fault.plan).is_file(), f"fault.plan={cfg.fault.plan}: no such file (a JSON list of faults, see tests/soak.py)")
    _check(cfg.task.direction in DIRECTIONS,
           f"task.direction={cfg.task.direction}: unknown, use one of {', '.join(DIRECTIONS)}")
    _check(cfg.mode in MODES, f"mode={cfg.mode}: unknown, use one of {', '.join(MODES)}")
    _check(cfg.data.split in SPLITS, f"data.split={cfg.data.split}: unknown, use one of {', '.join(SPLITS)}")
    if cfg.mode == "eval":
        _check(cfg.resume not in (None, "auto"), "mode=eval evaluates a checkpoint: pass resume=<checkpoint file or run dir>")
    else:
        _check(cfg.data.split == "val", f"data.split={cfg.data.split}: training validates on val; evaluate the test "
                                        "split with mode=eval resume=<checkpoint or run dir> data.split=test")
    if cfg.resume not in (None, "auto"):
        _check(Path(cfg.resume).exists(), f"resume={cfg.resume}: not found; pass a run dir, a checkpoint file, or resume=auto")
    _check(cfg.precision in PRECISIONS, f"precision={cfg.precision}: unknown, use one of {', '.join(PRECISIONS)}")
    _check(cfg.compile_mode in COMPILE_MODES,
           f"compile_mode={cfg.compile_mode}: unknown, use null or one of {', '.join(m for m in COMPILE_MODES if m)}")
    _check(trainer.accumulate_grad_batches >= 1,
           f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: must be >= 1 (micro-batches per update)")
    global_batch = trainer.global_batch_size
    if global_batch is not None:
        per_batch = cfg.data.batch_size * world_size
        _check(trainer.accumulate_grad_batches == 1,
               f"trainer.global_batch_size={global_batch} sets trainer.accumulate_grad_batches itself: "
               f"drop trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}")
        _check(global_batch >= 1 and global_batch % per_batch == 0,
               f"trainer.global_batch_size={global_batch}: must be a multiple of data.batch_size x world size = "
               f"{cfg.data.batch_size} x {world_size} = {per_batch} (it is accumulated from those batches): change "
               "trainer.global_batch_size or data.batch_size, for an elastic run so that every world size divides it")
    clip = trainer.gradient_clip_norm
    _check(clip is None or clip > 0, f"trainer.gradient_clip_norm={clip}: must be > 0, or null for no clipping")
    _check(0 <= trainer.label_smoothing < 1, f"trainer.label_smoothing={trainer.label_smoothing}: must be in [0, 1), e.g. 0.1")
    for key in ("mixup_alpha", "cutmix_alpha"):
        _check(cfg.data[key] >= 0, f"data.{key}={cfg.data[key]}: must be >= 0 (0: off), e.g. data.{key}=0.2")
    decay = cfg.ema.decay
    _check(decay is None or 0 < decay < 1, f"ema.decay={decay}: must be in (0, 1), e.g. ema.decay=0.999, or null for no EMA")
    _check(cfg.optim.lr_scaling in LR_SCALINGS,
           f"optim.lr_scaling={cfg.optim.lr_scaling}: unknown, use one of {', '.join(LR_SCALINGS)}")
    _check(cfg.optim.reference_batch_size >= 1, f"optim.reference_batch_size={cfg.optim.reference_batch_size}: must be >= 1")
    scheduler = cfg.scheduler
    for key in ("warmup_steps", "warmup_epochs"):
        _check(scheduler[key] >= 0, f"scheduler.{key}={scheduler[key]}: must be >= 0")
    if "min_lr" in scheduler:
        _check(0 <= scheduler.min_lr <= cfg.optim.lr, f"scheduler.min_lr={scheduler.min_lr}: must be in [0, optim.lr]")
    if "gamma" in scheduler:
        _check(0 < scheduler.gamma <= 1, f"scheduler.gamma={scheduler.gamma}: must be in (0, 1]")
        milestones = list(scheduler.milestones)
        _check(milestones == sorted(set(milestones)) and all(m >= 1 for m in milestones),
               f"scheduler.milestones={milestones}: must be increasing epochs >= 1")
    _check(cfg.strategy.nproc_per_node >= 0, f"strategy.nproc_per_node={cfg.strategy.nproc_per_node}: must be >= 0")
    _check(cfg.strategy.max_restarts >= 0, f"strategy.max_restarts={cfg.strategy.max_restarts}: must be >= 0")
    if strategy in MULTI_PROCESS:
        _check(
            launched or cfg.strategy.nproc_per_node >= 1,
            f"strategy={strategy} needs one process per device: launch it with "
            f"`torchrun --nproc_per_node=N train.py strategy={strategy} ...`, or add strategy.nproc_per_node=N",
        )
    else:
        _check(
            world_size == 1,
            f"strategy={strategy} runs one process, but {world_size} were started: "
            "use strategy=ddp, or torchrun --nproc_per_node=1",
        )
    if strategy in SHARDED:
        _check_fsdp_settings(cfg)
    if strategy == "hsdp":
        _check_shard_size(cfg.strategy.shard_size, world_size if launched else cfg.strategy.nproc_per_node)
    _check(cfg.activation_checkpointing in ACTIVATION_CHECKPOINTING, f"activation_checkpointing={cfg.activation_checkpointing}: "
                                                                     f"unknown, use one of {', '.join(ACTIVATION_CHECKPOINTING)}")
    _check(cfg.activation_checkpointing == "none" or strategy != "dp", f"activation_checkpointing={cfg.activation_checkpointing}: "
           "not with strategy=dp, whose replicas would run the first GPU's blocks; use strategy=ddp, or single")
    _check(not cfg.checkpoint.async_save or strategy != "dp", "checkpoint.async_save=true: not with strategy=dp; use "
                                                              "strategy=ddp (or single), or checkpoint.async_save=false")
    _check(cfg.activation_checkpointing_every >= 1, f"activation_checkpointing_every={cfg.activation_checkpointing_every}: "
                                                    "must be >= 1 (selective checkpoints every K-th block)")
    _check_profiler_settings(cfg.profiler)
    if cfg.data.get("download", False):
        _check(world_size == 1, "data.download=true: download with one process first, then launch torchrun with data.download=false")
    root = cfg.data.get("root")
    if root is not None and not cfg.data.get("download", False):
        _check(Path(root).is_dir(), f"data.root={root}: no such directory; point data.root at the dataset's folder")
    if cfg.syncbn and strategy in SYNCBN_WITHOUT_DDP:
        log.warning("syncbn=true has no effect with strategy=%s: %s", strategy, SYNCBN_WITHOUT_DDP[strategy])


def _check_profiler_settings(profiler: Any) -> None:
    """The profiler's schedule and CUDA's memory history (ddp/reporting/profiling.py)."""
    for key in ("wait", "warmup", "table_rows"):
        _check(profiler[key] >= 0, f"profiler.{key}={profiler[key]}: must be >= 0")
    _check(profiler.active >= 1, f"profiler.active={profiler.active}: must be >= 1 (the updates the trace records)")
    step = profiler.memory_snapshot_step
    _check(step is None or step >= 1, f"profiler.memory_snapshot_step={step}: must be a global step >= 1, or null")
    _check(step is None or profiler.memory_history, f"profiler.memory_snapshot_step={step} dumps the recorded memory "
                                                    "history: add profiler.memory_history=true")
    # device_count asks NVML where it can, so CUDA isn't initialised before `devices` restricts the visible GPUs
    _check(not profiler.memory_history or torch.cuda.device_count() > 0,
           "profiler.memory_history=true records CUDA allocations, but this run has no CUDA device: drop it "
           "(profiler.enabled=true traces CPU runs)")


def _check_fsdp_settings(cfg: Any) -> None:
    """What strategy=fsdp and hsdp don't do yet (docs/fsdp.md), refused before anything starts."""
    name = cfg.strategy.name
    _check(cfg.ema.decay is None, f"ema.decay={cfg.ema.decay}: the EMA keeps a full copy of the model, which "
                                  f"strategy={name} doesn't shard yet; use strategy=ddp, or ema.decay=null")
    _check(not cfg.channels_last, "channels_last=true: FSDP2 shards contiguous parameters only, and channels_last makes the "
                                  f"convolution weights non-contiguous; use channels_last=false with strategy={name}, or strategy=ddp")


def _check_shard_size(shard_size: int | None, world_size: int) -> None:
    """strategy=hsdp: world_size (the processes started, or to be started: strategy.nproc_per_node) splits into shard groups."""
    if shard_size is None:  # a node's processes: a torchrun launch of equal nodes divides into them
        return
    _check(shard_size >= 1, f"strategy.shard_size={shard_size}: must be >= 1, or null (the processes of a node)")
    _check(world_size % shard_size == 0, f"strategy.shard_size={shard_size} doesn't divide the {world_size} processes into "
                                         f"shard groups; use a divisor of {world_size}, or strategy.shard_size=null "
                                         "(the processes of a node)")
