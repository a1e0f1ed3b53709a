"""The optimizer update: mixed precision, gradient accumulation, clipping, the LR schedule and EMA,
each in the order that keeps it right under DDP, plus a non-finite check that costs no host sync."""

import bisect
import contextlib
import copy
import logging
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler

from ddp.config import ConfigError

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


class Diverged(RuntimeError):
    """A loss (or gradient norm) was not finite: the run stops without saving."""


class UpdateStep:
    """One optimizer update from a group of micro-batches.

    Every micro-batch: the task's training batch transforms (MixUp/CutMix for classification), forward
    and the task's loss under autocast, divided by the number of micro-batches in its group (the last
    group of an epoch may be shorter), backward (through the GradScaler for fp16).
    Under DDP the forward and backward of all but the group's last micro-batch run inside
    no_sync(), so gradients are all-reduced once per update; under FSDP they are reduce-scattered
    only after the last (set_requires_gradient_sync). After the last one: unscale (fp16) ->
    clip -> optimizer step (through the scaler) -> scaler update -> zero_grad -> scheduler step ->
    EMA update.

    The schedule advances once per update attempt, also when the fp16 scaler skips the optimizer
    step (inf gradients, mostly in the first steps while the scale calibrates): the LR stays a
    function of the step count alone, and knowing whether a step was skipped would cost a host
    sync every step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, task, device: torch.device, precision: str,
                 scheduler: lr_scheduler.LRScheduler | None = None, clip_norm: float | None = None,
                 ema: "EMA | None" = None, channels_last: bool = False):
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.task = task  # its train_batch and loss (tasks/__init__.py)
        self.device = device
        self.autocast_dtype = AUTOCAST_DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16" else None
        if self.scaler and scheduler:
            # the schedule steps on a skipped update too, by design (above); torch warns about it once
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
        self.clip_norm = clip_norm
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # 0 once a loss (or, without a scaler, a gradient norm) was not finite; read only where the
        # loop already waits for the device
        self.finite = torch.ones((), dtype=torch.int32, device=device)
        self.grad_norm: torch.Tensor | None = None  # of the last update, when clipping
        self.lr = optimizer.param_groups[0]["lr"]  # that the last update used
        self.precision = precision
        self.checked_step = 0  # every loss up to this update was finite

    def micro_step(self, images: torch.Tensor, targets: torch.Tensor, micro_index: int, group_size: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; the update itself after the group's last. Returns the loss."""
        images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        targets = targets.to(self.device, non_blocking=True)
        images, targets = self.task.train_batch(images, targets)
        images = images.contiguous(memory_format=self.memory_format)  # a transform may return another layout
        last = micro_index == group_size - 1
        accumulate_locally = not last and isinstance(self.model, DistributedDataParallel)
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
        with self.model.no_sync() if accumulate_locally else contextlib.nullcontext():
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                loss = self.task.loss(self.model(images), targets)
            scaled = loss / group_size
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        self.finite.mul_(torch.isfinite(loss.detach()))
        if last:
            self._update()
        return loss.detach()

    def _update(self) -> None:
        self.lr = self.optimizer.param_groups[0]["lr"]
        if self.clip_norm is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.grad_norm = _local(nn.utils.clip_grad_norm_(parameters, self.clip_norm))  # FSDP: a replicated DTensor
            if self.scaler is None:  # with fp16 an inf norm only makes the scaler skip this step
                self.finite.mul_(torch.isfinite(self.grad_norm))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(_bare(self.model))

    def check_finite(self, step: int, model: nn.Module | None = None) -> None:
        """Raise Diverged on every rank if any rank saw a non-finite loss since the last check (or
        holds non-finite weights, when `model` is given). A collective with one host read: call it
        only where the loop waits for the device anyway (log steps, epoch ends, saves)."""
        flag = self.finite.clone()
        if model is not None:
            flag.mul_(parameters_finite(model).to(flag.device))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # one rank stopping alone would hang the others
        if not flag.item():
            raise Diverged(
                f"training diverged: a non-finite loss or gradient norm between steps {self.checked_step} and {step} "
                f"(precision={self.precision}, lr={self.lr:g}); stopped without saving, the newest checkpoint is the "
                "last good one: lower optim.lr, or set trainer.gradient_clip_norm"
            )
        self.checked_step = step

    def state_dict(self) -> dict:
        """What a resume needs besides the model and optimizer."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "ema": self.ema.state_dict() if self.ema else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint (ddp.resume.check_update_state_fits has checked that the parts match)."""
        for name in ("scheduler", "scaler", "ema"):
            if getattr(self, name) is not None:
                getattr(self, name).load_state_dict(state[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a sharded parameter's shard; a reduced value's full value); a plain tensor as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model


class EMA(nn.Module):
    """An exponential moving average of a model's weights and buffers, updated without a host sync.

    torch's AveragedModel (torchvision's reference recipe) branches on its tensor counter every
    update (`bool(n_averaged == 0)`) and copies it to each (device, dtype) group: on a GPU both wait
    for the device. Here the count is a Python int. The first update copies the model; each later
    one is `ema = lerp(ema, w, 1 - decay)` over the floating-point weights and buffers in one
    `torch._foreach_lerp_` (get_ema_multi_avg_fn's math), and integer buffers (BatchNorm's
    num_batches_tracked) are copied. Its state_dict is AveragedModel's, `module.<key>` plus
    `n_averaged`, so checkpoints written with either load into it.
    """

    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.decay = decay
        self.n_averaged = 0  # updates so far
        self._split_tensors()
        self.register_state_dict_post_hook(_save_count)
        self.register_load_state_dict_pre_hook(_load_count)

    def _split_tensors(self) -> None:
        """Which of the EMA's tensors are averaged (floating point) and which copied (integer buffers),
        found once rather than at every update. The model's tensors pair with them by position: both
        list their parameters, then their buffers, in the same order."""
        tensors = _tensors(self.module)
        self._floating = [i for i, tensor in enumerate(tensors) if tensor.is_floating_point()]
        self._integer = [i for i, tensor in enumerate(tensors) if not tensor.is_floating_point()]
        self._all_tensors = tensors
        self._floating_tensors = [tensors[i] for i in self._floating]
        self._integer_tensors = [tensors[i] for i in self._integer]

    def _apply(self, fn, *args, **kwargs) -> "EMA":
        super()._apply(fn, *args, **kwargs)
        self._split_tensors()  # .to() and its kin put new tensors in place of the buffers
        return self

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        current = _tensors(model)
        if self.n_averaged == 0:
            torch._foreach_copy_(self._all_tensors, current)
        else:
            torch._foreach_lerp_(self._floating_tensors, [current[i] for i in self._floating], 1 - self.decay)
            if self._integer_tensors:  # a model without BatchNorm has none
                torch._foreach_copy_(self._integer_tensors, [current[i] for i in self._integer])
        self.n_averaged += 1


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _save_count(ema: EMA, state_dict: dict, prefix: str, local_metadata) -> None:
    state_dict[prefix + "n_averaged"] = torch.tensor(ema.n_averaged)


def _load_count(ema: EMA, state_dict: dict, prefix: str, *_) -> None:
    ema.n_averaged = int(state_dict.pop(prefix + "n_averaged"))  # load_state_dict passes a copy


def build_ema(model: nn.Module, decay: float | None) -> EMA | None:
    """The EMA of `model` (on its device) with that decay, or None for none. Its update does no host
    read and copies nothing between devices, so it never waits for the GPU."""
    if decay is None:
        return None
    return EMA(model, decay)


class PlannedLR(lr_scheduler.LRScheduler):
    """The LR of update `last_epoch`, in closed form: a linear warmup ((step + 1) / warmup x the base
    LR, never 0), then `cosine` (from `decay_from` x the base LR at update `decay_start` down to min_lr
    at update `end`, and min_lr after it) or `step` (x gamma at each milestone update).

    torch's LinearLR, CosineAnnealingLR and MultiStepLR keep the LR and the run's length in their
    state, so a resume could change neither the base LR nor the length (`resume_schedule`), and
    CosineAnnealingLR is periodic past T_max: an extended run's LR would rise again. The plan is
    plain numbers, which the checkpoint holds (LRScheduler.state_dict saves every attribute).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, warmup: int, end: int, *, min_lr: float = 0.0,
                 milestones: tuple[int, ...] | list[int] = (), gamma: float = 1.0):
        self.kind, self.warmup, self.end = kind, warmup, end
        self.min_lr, self.milestones, self.gamma = min_lr, list(milestones), gamma
        self.decay_start, self.decay_from = warmup, 1.0
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, base_lr) for base_lr in self.base_lrs]

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup:
            return base_lr * (step + 1) / self.warmup
        if self.kind == "step":
            return base_lr * self.gamma ** bisect.bisect_right(self.milestones, step)
        progress = min((step - self.decay_start) / max(self.end - self.decay_start, 1), 1.0)
        return self.min_lr + (base_lr * self.decay_from - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2

    def load_state_dict(self, state_dict: dict) -> None:
        if "decay_start" not in state_dict:  # saved by torch's chained schedulers, before this class
            state_dict = self._from_torch_state(state_dict)
        super().load_state_dict(state_dict)

    def _from_torch_state(self, state: dict) -> dict:
        """SequentialLR([LinearLR, CosineAnnealingLR or MultiStepLR]), or the second alone: this plan with
        their step, base LR and (cosine) length."""
        decay = state["_schedulers"][-1] if "_schedulers" in state else state
        warmup = state["_milestones"][0] if "_milestones" in state else 0
        end = warmup + decay["T_max"] if "T_max" in decay else self.end
        return {**self.state_dict(), "last_epoch": state["last_epoch"], "base_lrs": decay["base_lrs"], "end": end}


def build_scheduler(scheduler_cfg, optimizer: torch.optim.Optimizer, total_updates: int,
                    updates_per_epoch: int) -> PlannedLR | None:
    """Stepped once per optimizer update: `none`, `cosine` (linear warmup, then cosine to min_lr) or
    `step` (x gamma at each milestone epoch, after an optional warmup)."""
    name = scheduler_cfg.name
    if name == "none":
        return None
    warmup = warmup_updates(scheduler_cfg, updates_per_epoch)
    if name == "cosine":
        return PlannedLR(optimizer, name, warmup, total_updates, min_lr=scheduler_cfg.min_lr)
    milestones = [epoch * updates_per_epoch for epoch in scheduler_cfg.milestones]
    return PlannedLR(optimizer, name, warmup, total_updates, milestones=milestones, gamma=scheduler_cfg.gamma)


def resume_schedule(optimizer: torch.optim.Optimizer, scheduler: PlannedLR | None, base_lr: float,
                    total_updates: int, is_main: bool = True) -> None:
    """After a resume loaded the optimizer's and the scheduler's states, which hold the base LR and
    length of the run that saved them: continue at this run's base LR (`scaled_lr`: a changed optim.lr,
    or lr_scaling at another global batch), the schedule rescaled to it, and end a cosine decay at this
    run's last update. A changed length re-plans the decay from the LR it has reached down to min_lr
    at the new end, so extending a run never raises its LR (past its end, the LR stays at min_lr).
    The warmup, min_lr and milestones continue as the checkpoint planned them. A changed base LR is a
    warning on the main rank only (`is_main`): every rank's console would repeat it."""
    saved_base_lr = scheduler.base_lrs[0] if scheduler else optimizer.param_groups[0]["lr"]
    if base_lr != saved_base_lr:
        log.log(logging.WARNING if is_main else logging.INFO, "optim.lr: the checkpoint trained at a base LR of %g, this run's is %g (optim.lr, optim.lr_scaling "
                    "at its global batch): it applies from here, the schedule rescaled to it", saved_base_lr, base_lr)
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = base_lr
        return
    step = scheduler.last_epoch
    if total_updates != scheduler.end and scheduler.kind == "cosine":
        log.info("the schedule was planned for %d updates, this run has %d: the cosine decays from update %d's LR to "
                 "min_lr at update %d", scheduler.end, total_updates, max(step, scheduler.warmup), total_updates)
        if step > scheduler.decay_start:  # the decay has begun: re-plan it from where it stands
            scheduler.decay_from = scheduler.lr_at(step, base_lr) / base_lr
            scheduler.decay_start = step
    scheduler.end = total_updates
    scheduler.base_lrs = [base_lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"], group["lr"] = base_lr, scheduler.lr_at(step, base_lr)


def warmup_updates(scheduler_cfg, updates_per_epoch: int) -> int:
    return scheduler_cfg.warmup_steps + math.ceil(scheduler_cfg.warmup_epochs * updates_per_epoch)


def check_schedule(scheduler_cfg, total_updates: int, updates_per_epoch: int) -> None:
    """A schedule that can't happen in this run's length is a config error, before anything starts."""
    warmup = warmup_updates(scheduler_cfg, updates_per_epoch)
    if warmup >= total_updates and scheduler_cfg.name != "none" or warmup > total_updates:
        raise ConfigError(f"scheduler.warmup_steps/warmup_epochs: {warmup} warmup updates, but the run has only "
                          f"{total_updates}: shorten the warmup or train longer")
    if scheduler_cfg.name == "step":
        for epoch in scheduler_cfg.milestones:
            if epoch * updates_per_epoch <= warmup:
                raise ConfigError(f"scheduler.milestones: epoch {epoch} falls inside the warmup; "
                                  "use milestones after it, in epochs")


def scaled_lr(optim_cfg, global_batch: int) -> float:
    """optim.lr, scaled for the global batch (batch x ranks x accumulation) by optim.lr_scaling."""
    ratio = global_batch / optim_cfg.reference_batch_size
    return optim_cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim_cfg.lr_scaling]


def parameters_finite(model: nn.Module) -> torch.Tensor:
    """A device flag (int32 0/1): every parameter and buffer of `model` (this rank's shards, under FSDP) is finite."""
    flags = [torch.isfinite(_local(t)).all() for t in model.state_dict().values() if t.is_floating_point()]
    return torch.stack(flags).all().to(torch.int32) if flags else torch.ones((), dtype=torch.int32)
