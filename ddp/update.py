"""The optimizer update: mixed precision, gradient accumulation, clipping, the LR schedule and EMA,
each in the order that keeps it right under DDP, plus a non-finite check that costs no host sync."""

import contextlib
import copy
import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler

from ddp.config import ConfigError

AUTOCAST_DTYPES = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


class Diverged(RuntimeError):
    """A loss (or gradient norm) was not finite: the run stops without saving."""


class UpdateStep:
    """One optimizer update from a group of micro-batches.

    Every micro-batch: MixUp/CutMix if on, forward under autocast, the (label-smoothed) cross-entropy
    against the hard or mixed targets, divided by the number of micro-batches in its
    group (the last group of an epoch may be shorter), backward (through the GradScaler for fp16).
    Under DDP the forward and backward of all but the group's last micro-batch run inside
    no_sync(), so gradients are all-reduced once per update. After the last one: unscale (fp16) ->
    clip -> optimizer step (through the scaler) -> scaler update -> zero_grad -> scheduler step ->
    EMA update.

    The schedule advances once per update attempt, also when the fp16 scaler skips the optimizer
    step (inf gradients, mostly in the first steps while the scale calibrates): the LR stays a
    function of the step count alone, and knowing whether a step was skipped would cost a host
    sync every step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device, precision: str,
                 scheduler: lr_scheduler.LRScheduler | None = None, clip_norm: float | None = None,
                 ema: "EMA | None" = None, channels_last: bool = False, label_smoothing: float = 0.0,
                 batch_mix: Callable | None = None):
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.label_smoothing = label_smoothing
        self.batch_mix = batch_mix  # (images, labels) -> (images, soft targets), e.g. data.mix.build_batch_mix's
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

    def micro_step(self, images: torch.Tensor, labels: torch.Tensor, micro_index: int, group_size: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; the update itself after the group's last. Returns the loss."""
        images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        targets = labels.to(self.device, non_blocking=True)
        if self.batch_mix is not None:
            images, targets = self.batch_mix(images, targets)  # soft targets: class probabilities
            images = images.contiguous(memory_format=self.memory_format)  # mixing may return another layout
        last = micro_index == group_size - 1
        accumulate_locally = not last and isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if accumulate_locally else contextlib.nullcontext():
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                loss = F.cross_entropy(self.model(images), targets, label_smoothing=self.label_smoothing)
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
            self.grad_norm = nn.utils.clip_grad_norm_(parameters, self.clip_norm)
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
        self.register_state_dict_post_hook(_save_count)
        self.register_load_state_dict_pre_hook(_load_count)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.n_averaged == 0:
            torch._foreach_copy_(averaged, current)
        else:
            floating = [i for i, t in enumerate(averaged) if t.is_floating_point()]
            torch._foreach_lerp_([averaged[i] for i in floating], [current[i] for i in floating], 1 - self.decay)
            for ema_tensor, tensor in zip(averaged, current):
                if not ema_tensor.is_floating_point():
                    ema_tensor.copy_(tensor)
        self.n_averaged += 1


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


def build_scheduler(scheduler_cfg, optimizer: torch.optim.Optimizer, total_updates: int,
                    updates_per_epoch: int) -> lr_scheduler.LRScheduler | None:
    """torch.optim.lr_scheduler, stepped once per optimizer update: `none`, `cosine` (linear warmup,
    then cosine to min_lr) or `step` (x gamma at each milestone epoch, after an optional warmup)."""
    name = scheduler_cfg.name
    if name == "none":
        return None
    warmup = warmup_updates(scheduler_cfg, updates_per_epoch)
    if name == "cosine":
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_updates - warmup, 1), eta_min=scheduler_cfg.min_lr)
    else:
        milestones = [epoch * updates_per_epoch - warmup for epoch in scheduler_cfg.milestones]
        main = lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=scheduler_cfg.gamma)
    if warmup == 0:
        return main
    # (step + 1) / warmup: the first LR is base_lr / warmup, never 0, and step warmup - 1 has base_lr
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=max(warmup - 1, 1))
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


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
    """A device flag (int32 0/1): every parameter and buffer of `model` is finite."""
    flags = [torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()]
    return torch.stack(flags).all().to(torch.int32) if flags else torch.ones((), dtype=torch.int32)
