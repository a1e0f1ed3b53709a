"""The optimizer from optim.* (checked early, on a dummy parameter), its LR scaled for the global
batch, and the LR schedule per update, planned in closed form so that a resume can change the base
LR or the run's length."""

import bisect
import logging
import math

import torch
from hydra.utils import instantiate
from torch.optim import lr_scheduler

from ddp.config.builder_options import instantiate_checked
from ddp.config.schema import ConfigError

log = logging.getLogger(__name__)

# Keys of OptimConfig that say how to scale the LR, not for the torch.optim class.
LR_SCALING_KEYS = ("lr_scaling", "reference_batch_size")


def optimizer_node(optim_cfg) -> dict:
    """What the torch.optim class gets: optim.* without the LR scaling keys."""
    return {key: value for key, value in optim_cfg.items() if key not in LR_SCALING_KEYS}


def check_optimizer(optim_cfg) -> None:
    """Settings the torch.optim class rejects, as a one-line error now: the real optimizer needs the
    wrapped model, so this builds one on a dummy parameter."""
    options = optimizer_node(optim_cfg)
    instantiate_checked(options, "optim", params=[torch.zeros(1, requires_grad=True)])


def build_optimizer(optim_cfg, params, lr: float) -> torch.optim.Optimizer:
    """The torch.optim class of optim._target_ over `params`, at `lr` (scaled_lr's)."""
    return instantiate(optimizer_node(optim_cfg), params=params, lr=lr)


def scaled_lr(optim_cfg, global_batch: int) -> float:
    """optim.lr, scaled for the global batch (batch x ranks x accumulation) by optim.lr_scaling."""
    ratio = global_batch / optim_cfg.reference_batch_size
    return optim_cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim_cfg.lr_scaling]


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
