"""Exact resume: choosing the checkpoint, and the per-rank state that makes the rest bit-identical."""

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp.checkpoints.checkpoint import CheckpointError, is_sharded_checkpoint, load_checkpoint, load_latest_checkpoint, sharded_model_shapes
from ddp.config.schema import SHARDED, ConfigError
from ddp.loading.samplers import resume_point
from ddp.training.progress import Position, TrainingLength
from ddp.training.optimizer import resume_schedule

log = logging.getLogger(__name__)


def checkpoint_state(model: nn.Module | None, optimizer, update_state: dict[str, Any], position: Position, samples_in_epoch: int,
                     rank_states: list[dict[str, Any]], config: dict, copy: bool = False) -> dict[str, Any]:
    """Everything a resume needs, as plain containers and CPU tensors: it loads with weights_only=True
    on any host, GPUs or not (optimizer.load_state_dict moves the state back to the parameters' device).
    `update_state`: the scheduler, GradScaler and EMA states (None where off). `model` None: all but the
    model's and the optimizer's states (a sharded checkpoint holds those in its shards). `samples_in_epoch`: the
    position's (Position.samples_in_epoch). `copy`: no tensor shared with the training (to_cpu)."""
    return {
        **({"model": to_cpu(model.state_dict(), copy), "optimizer": to_cpu(optimizer.state_dict(), copy)} if model is not None
           else {}),
        **to_cpu(update_state, copy),
        "epoch": position.epoch,
        "samples_in_epoch": samples_in_epoch,  # what a resume reads
        "batch_in_epoch": position.batch_in_epoch,  # at this world size, for reading
        "global_step": position.global_step,
        "tensorboard_step": position.global_step,
        "world_size": len(rank_states),
        "ranks": rank_states,
        "config": config,
    }


def to_cpu(state: Any, copy: bool = False) -> Any:
    """`state` with every tensor on the CPU, so a checkpoint never names a CUDA device; `copy`: copies of the CPU
    tensors too, which training may change while a background save writes them (checkpoint.async_save)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=copy)
    if isinstance(state, dict):
        return {key: to_cpu(value, copy) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value, copy) for value in state)
    return state


def resume_position(path: Path, checkpoint: dict[str, Any], batch_size: int, world_size: int, rank: int,
                    train_size: int) -> tuple[Position, dict[str, Any] | None]:
    """Where to continue, and this rank's state to restore (None if the world size changed)."""
    saved_world_size = checkpoint["world_size"]
    # checkpoints from before samples_in_epoch: their batches were all full, on every rank
    samples = checkpoint.get("samples_in_epoch",
                             checkpoint["batch_in_epoch"] * checkpoint["config"]["data"]["batch_size"] * saved_world_size)
    samples = min(samples, train_size)  # older checkpoints counted an epoch's partial last batch as full
    start, batches = resume_point(samples, batch_size, world_size)
    position = Position(checkpoint["epoch"], batches, checkpoint["global_step"], start)
    rank_state = None
    if saved_world_size == world_size:
        rank_state = checkpoint["ranks"][rank]
        position.epoch_totals = torch.tensor(rank_state["epoch_totals"], dtype=torch.float64)
    else:
        log.warning("checkpoint has world_size=%d, this run %d: the data position is kept exactly (sample %d of epoch %d "
                    "on), but the per-rank RNG states don't carry over: bit-identical only at an equal world size",
                    saved_world_size, world_size, samples, position.epoch)
        if rank == 0:  # the epoch's loss so far, all of it, so the epoch's train_loss stays exact
            totals = [state["epoch_totals"] for state in checkpoint["ranks"]]
            position.epoch_totals = torch.tensor(totals, dtype=torch.float64).sum(dim=0)
    log.info("resumed from %s at epoch %d, batch %d, step %d (%d samples of the epoch trained)",
             path, position.epoch, position.batch_in_epoch, position.global_step, samples)
    return position, rank_state


def resume_training(resumed: tuple[Path, dict[str, Any]], update, base_lr: float, length: TrainingLength, batch_size: int,
                    world_size: int, rank: int) -> tuple[Position, dict[str, Any] | None]:
    """Load the optimizer, scheduler, GradScaler and EMA states of the checkpoint `resumed` (path, checkpoint)
    into `update` (an UpdateStep), to go on at this run's base LR and length; returns `resume_position`'s.
    A sharded checkpoint's model and optimizer states load here, into the sharded model (update.model)."""
    path, checkpoint = resumed
    if checkpoint.get("sharded"):
        from ddp.checkpoints.sharded_checkpoint import load_sharded_state  # DCP, imported where it's used (ddp/distributed/fsdp.py)

        load_sharded_state(path, update.model, update.optimizer, checkpoint["optimizer_param_groups"])
    else:
        update.optimizer.load_state_dict(checkpoint["optimizer"])
    update.load_state_dict(checkpoint)
    resume_schedule(update.optimizer, update.scheduler, base_lr, length.total_updates, is_main=rank == 0)
    return resume_position(path, checkpoint, batch_size, world_size, rank, length.train_size)


def is_restart(env) -> bool:
    """A torchrun restart, or a submitit task (a requeued job runs again in the same job dir; its first
    run finds no checkpoint there): find_resume_checkpoint continues from the run dir's own newest."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or env.launcher == "submitit"


def find_resume_checkpoint(resume: str | None, run_dir: Path, restarted: bool) -> tuple[Path, dict[str, Any]] | None:
    """`resume`: None (fresh), `auto`, a run dir, or a checkpoint (a file, or a sharded one's dir). A restarted run (torchrun's
    restart, a requeued SLURM job) continues from its own run dir's newest checkpoint when there is
    one, whatever `resume` says: that is where the last attempt saved."""
    if restarted and (found := load_latest_checkpoint(run_dir)) is not None:
        return found
    if resume is None:
        return None
    if resume == "auto":
        found = load_latest_checkpoint(run_dir)
        if found is None:
            log.info("resume=auto: no checkpoint in %s, starting fresh", run_dir)
        return found
    path = Path(resume)
    if path.is_dir() and not is_sharded_checkpoint(path):  # a run dir; a sharded checkpoint is a dir too
        found = load_latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"resume={resume}: no loadable checkpoint in {path / 'checkpoints'}")
        return found
    try:
        return path, load_checkpoint(path)
    except CheckpointError as error:
        raise ConfigError(f"resume={resume}: {error}") from None


def load_resumed_weights(model: nn.Module, resumed: tuple[Path, dict[str, Any]]) -> None:
    """The checkpoint's weights into the bare `model`, once check_resume_fits passed. A sharded checkpoint's
    (a dir's: strategy=fsdp, hsdp) shards load into the sharded model (resume_training): here only the shapes in
    its DCP index are checked, so a misfit is refused before any process group."""
    path, checkpoint = resumed
    if not checkpoint.get("sharded"):
        load_model_state(model, checkpoint["model"], path)
    else:
        check_state_fits(model, sharded_model_shapes(path), path)


def load_model_state(model: nn.Module, state_dict: dict[str, torch.Tensor], source: Path) -> None:
    """load_state_dict(strict=True), after check_state_fits."""
    check_state_fits(model, {key: value.shape for key, value in state_dict.items()}, source)
    model.load_state_dict(state_dict, strict=True)


def check_state_fits(model: nn.Module, shapes: dict[str, torch.Size], source: Path) -> None:
    """The checkpoint's tensors (`shapes`: name to shape) are exactly the model's, or a one-line error with state_misfit's count."""
    if misfit := state_misfit(model, shapes):
        raise ConfigError(f"resume: {source} does not fit this model (model.* differs from the checkpoint's): {misfit}")


def state_misfit(model: nn.Module, shapes: dict[str, torch.Size]) -> str:
    """How tensors of `shapes` (name to shape) differ from the model's: the missing, unexpected and reshaped keys
    counted, the first few of each named; "" where they fit exactly."""
    own = {key: value.shape for key, value in model.state_dict().items()}
    missing = sorted(own.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - own.keys())
    reshaped = sorted(key for key in own.keys() & shapes.keys() if tuple(own[key]) != tuple(shapes[key]))
    return ", ".join(_some(keys, kind) for keys, kind in ((missing, "missing"), (unexpected, "unexpected"),
                                                         (reshaped, "reshaped")) if keys)


def _some(keys: list[str], kind: str, shown: int = 3) -> str:
    """`2 missing keys ['a', 'b']`; past `shown` keys, `...` stands for the rest (a resnet's list is thousands of characters)."""
    listed = ", ".join(repr(key) for key in keys[:shown]) + (", ..." if len(keys) > shown else "")
    return f"{len(keys)} {kind} key{'s' if len(keys) > 1 else ''} [{listed}]"


def check_update_state_fits(checkpoint: dict[str, Any], source: Path, cfg) -> None:
    """The scheduler, GradScaler and EMA states of the checkpoint match what this run keeps."""
    for key, kept, setting in (
        ("scheduler", cfg.scheduler.name != "none", f"scheduler={cfg.scheduler.name}"),
        ("scaler", cfg.precision == "16", f"precision={cfg.precision}"),
        ("ema", cfg.ema.decay is not None, f"ema.decay={cfg.ema.decay}"),
    ):
        if (checkpoint.get(key) is not None) != kept:
            saved = "with" if checkpoint.get(key) is not None else "without"
            raise ConfigError(f"resume: {source} was saved {saved} a {key} state, which {setting} "
                              f"{'needs' if kept else 'has no use for'}: resume with the settings it was trained with")


def check_resume_fits(checkpoint: dict[str, Any], source: Path, cfg, world_size: int, train_size: int) -> None:
    """The checkpoint is of a kind the strategy resumes from (a file, or a sharded one's dir), and what this run keeps of the
    update (check_update_state_fits) and the epoch's sample order (check_sample_order_fits) fit it."""
    strategy, sharded = cfg.strategy.name, bool(checkpoint.get("sharded"))
    if sharded != (strategy in SHARDED):
        kind = "a sharded checkpoint (strategy=fsdp's or hsdp's)" if sharded else "a checkpoint file"
        raise ConfigError(f"resume: {source} is {kind}, which strategy={strategy} doesn't resume from yet; resume it with "
                          f"strategy={'fsdp or hsdp' if sharded else 'single, dp or ddp'}, or start from its weights with "
                          "model.weights_path")
    check_update_state_fits(checkpoint, source, cfg)
    check_sample_order_fits(checkpoint, source, cfg.data, world_size, train_size)


def check_sample_order_fits(checkpoint: dict[str, Any], source: Path, data_cfg, world_size: int, train_size: int) -> None:
    """A resume mid-epoch continues the epoch's order from the sample the checkpoint reached. With
    data.aspect_ratio_groups on, that order depends on the groups and the global batch (batch_size x world
    size; ddp/loading/samplers.py: grouped_order): another of either would train some images twice and
    others not at all, so both stay the checkpoint's until the epoch ends. The world size alone may change."""
    saved = checkpoint["config"]["data"]
    samples = checkpoint.get("samples_in_epoch", checkpoint["batch_in_epoch"] * saved["batch_size"] * checkpoint["world_size"])
    saved_groups, groups = saved.get("aspect_ratio_groups", 0), data_cfg.get("aspect_ratio_groups", 0)
    saved_batch, batch = saved["batch_size"] * checkpoint["world_size"], data_cfg.batch_size * world_size
    if 0 < samples < train_size and (saved_groups, saved_groups and saved_batch) != (groups, groups and batch):
        raise ConfigError(f"resume: {source} stopped mid-epoch with data.aspect_ratio_groups={saved_groups} at a global batch "
                          f"of {saved_batch}, whose order this run's {groups} at {batch} wouldn't continue: resume with "
                          f"data.aspect_ratio_groups={saved_groups} and data.batch_size x world size = {saved_batch}, "
                          "or from a checkpoint at an epoch's end")


def capture_rank_state(epoch_totals: torch.Tensor, cuda_devices: list[int]) -> dict[str, Any]:
    """This rank's random state and partial-epoch loss, as plain containers and tensors. (The data's
    draws need no state: they are seeded per sample, ddp/loading/sample_seeds.py.)

    `cuda_devices`: the GPUs this rank computes on (its own device; DataParallel's device_ids).
    Only their RNG states are kept, so a resume that sees fewer or renumbered GPUs restores the
    streams of the devices it trains on, not another device's or an IndexError.
    """
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": [torch.cuda.get_rng_state(index) for index in cuda_devices],
        "python_rng": random.getstate(),
        "epoch_totals": epoch_totals.tolist(),
    }


def restore_rank_state(state: dict[str, Any], cuda_devices: list[int]) -> None:
    torch.set_rng_state(state["torch_rng"])
    if len(state["cuda_rng"]) != len(cuda_devices):
        log.warning("checkpoint holds the CUDA RNG state of %d device(s), this rank trains on %d: "
                    "restoring the first %d", len(state["cuda_rng"]), len(cuda_devices), min(len(state["cuda_rng"]), len(cuda_devices)))
    for rng_state, index in zip(state["cuda_rng"], cuda_devices):
        torch.cuda.set_rng_state(rng_state, index)
    random.setstate(state["python_rng"])


def gather_rank_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's state, on every rank (a collective: all ranks must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states
