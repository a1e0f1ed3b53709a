"""The optimizer update: mixed precision, gradient accumulation, clipping, the LR schedule and EMA,
each in the order that keeps it right under DDP, plus a non-finite check that costs no host sync."""

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler

from ddp.config.schema import ConfigError
from ddp.distributed.dtensor import is_sharded, local_tensor
from ddp.loading.batches import BatchPlacement
from ddp.training.ema import EMA

AUTOCAST_DTYPES = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}
# The train/<name> scalars the loop logs itself (ddp/reporting/monitor.py): a task's extra term can't take a name of them.
LOOP_SCALARS = frozenset({"loss", "lr", "grad_norm", "samples_per_s", "samples_per_s_per_rank", "epoch_loss", "epoch_time_s"})


class Diverged(RuntimeError):
    """A loss (or gradient norm) was not finite: the run stops without saving."""

    on_every_rank = True  # raised once the ranks agreed (check_finite, checked): rank 0 alone says it (ddp/jobs/failures.py)


class UpdateStep:
    """One optimizer update from a group of micro-batches.

    Every micro-batch: the batch to the device (uint8 images from loader workers normalized there), the
    task's training step under autocast (by default its batch transforms, MixUp/CutMix for classification,
    the forward and its loss; tasks/__init__.py),
    the loss divided by the number of micro-batches in its group (the last group of an epoch may be
    shorter), backward (through the GradScaler for fp16).
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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, task, precision: str,
                 scheduler: lr_scheduler.LRScheduler | None = None, clip_norm: float | None = None,
                 ema: "EMA | None" = None, placement: BatchPlacement = BatchPlacement()):
        self.model, self.optimizer, self.scheduler, self.ema = model, optimizer, scheduler, ema
        self.task = task  # its training_step (tasks/__init__.py)
        # batches go where the model computes: its parameters' device (DataParallel's first replica, a shard's)
        self.device = device = next(model.parameters()).device
        sharded = is_sharded(model)
        # FSDP's MixedPrecisionPolicy casts instead of autocast (ddp/distributed/fsdp.py)
        self.autocast_dtype = None if sharded else AUTOCAST_DTYPES[precision]
        self.scaler = None
        if precision == "16" and sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # agrees across ranks on whether any rank's gradient shards held an inf; its found_inf is
            # a 1-element tensor, which DTensor warns about at every unscale
            self.scaler = ShardedGradScaler(device.type)
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1 and ndim!=0")
        elif precision == "16":
            self.scaler = torch.amp.GradScaler(device.type)
        if self.scaler and scheduler:
            # the schedule steps on a skipped update too, by design (above); torch warns about it once
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
        self.clip_norm = clip_norm
        self.placement = placement
        # 0 once a loss (or, without a scaler, a gradient norm) was not finite; read only where the
        # loop already waits for the device
        self.finite = torch.ones((), dtype=torch.int32, device=device)
        self.grad_norm: torch.Tensor | None = None  # of the last update, when clipping
        self.lr = optimizer.param_groups[0]["lr"]  # that the last update used
        self.precision = precision
        self.checked_step = 0  # every loss up to this update was finite
        self.gradient_bytes = 0  # this rank's, measured at the first update (state_bytes)
        self.terms: dict[str, torch.Tensor] = {}  # the task's extra loss terms of the last micro-batch, detached

    def micro_step(self, batch, micro_index: int, group_size: int) -> torch.Tensor:
        """Forward and backward of one micro-batch (any nesting of tensors, ddp/loading/batches.py); the
        update itself after the group's last. Returns the loss; the task's extra terms are in `terms`."""
        batch = self.placement(batch, self.device)
        last = micro_index == group_size - 1
        accumulate_locally = not last and isinstance(self.model, DistributedDataParallel)
        if is_sharded(self.model):
            self.model.set_requires_gradient_sync(last)
        with self.model.no_sync() if accumulate_locally else contextlib.nullcontext():
            loss = self.forward_and_loss(batch)
            self.backward(loss / group_size if group_size > 1 else loss)  # x / 1 is x: one op fewer a step
        self.finite.mul_(torch.isfinite(loss.detach()))
        if last:
            self.optimizer_step()
        return loss.detach()

    # The phases of micro_step, one method each: a profiler marks them on its instance (ddp/reporting/profiling.py).
    PHASES = ("forward_and_loss", "backward", "optimizer_step")

    def forward_and_loss(self, batch) -> torch.Tensor:
        """The task's training step under autocast; its extra loss terms go to `terms`."""
        # without a dtype, no autocast context at all: entering a disabled one costs ~10 us a step
        with torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext():
            loss = self.task.training_step(self.model, batch)
        if isinstance(loss, dict):
            self.terms = {name: term.detach() for name, term in loss.items() if name != "loss"}
            check_loss_terms(self.task, loss)
            loss = loss["loss"]
        return loss

    def backward(self, scaled_loss: torch.Tensor) -> None:
        (self.scaler.scale(scaled_loss) if self.scaler else scaled_loss).backward()

    def optimizer_step(self) -> None:
        """The update after a group's last micro-batch: unscale, clip, step, zero_grad, schedule, EMA."""
        self.lr = self.optimizer.param_groups[0]["lr"]
        if self.clip_norm is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.grad_norm = local_tensor(nn.utils.clip_grad_norm_(parameters, self.clip_norm))  # FSDP: a replicated DTensor
            if self.scaler is None:  # with fp16 an inf norm only makes the scaler skip this step
                self.finite.mul_(torch.isfinite(self.grad_norm))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if not self.gradient_bytes:  # once: the gradients the optimizer steps with (this rank's shards, under FSDP)
            self.gradient_bytes = local_bytes(p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(_bare(self.model))

    def check_finite(self, step: int, model: nn.Module | None = None) -> None:
        """Raise Diverged on every rank if any rank saw a non-finite loss since the last check (or
        holds non-finite weights, when `model` is given). A collective with one host read: call it
        only where the loop waits for the device anyway (saves; at log steps and epoch ends the
        monitor checks `finite` in the collective it makes anyway, then calls `checked`)."""
        flag = self.finite.clone()
        if model is not None:
            flag.mul_(parameters_finite(model).to(flag.device))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # one rank stopping alone would hang the others
        self.checked(step, bool(flag.item()))

    def checked(self, step: int, every_rank_finite: bool) -> None:
        """After the ranks agreed on whether every one's losses were finite up to `step`: Diverged if not."""
        if not every_rank_finite:
            raise Diverged(
                f"training diverged: a non-finite loss or gradient norm between steps {self.checked_step} and {step} "
                f"(precision={self.precision}, lr={self.lr:g}); stopped without saving, the newest checkpoint is the "
                "last good one: lower optim.lr, or set trainer.gradient_clip_norm"
            )
        self.checked_step = step

    def state_bytes(self) -> list[int]:
        """This rank's bytes of parameters, gradients (as at an update) and optimizer state, from the
        tensors it holds: under FSDP its local shards, so the figures show what sharding saves."""
        optimizer_state = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return [local_bytes(self.model.parameters()), self.gradient_bytes, local_bytes(optimizer_state)]

    def state_dict(self) -> dict:
        """What a resume needs besides the model and optimizer."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "ema": self.ema.state_dict() if self.ema else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """From a checkpoint (ddp.checkpoints.resume.check_update_state_fits has checked that the parts match)."""
        for name in ("scheduler", "scaler", "ema"):
            if getattr(self, name) is not None:
                getattr(self, name).load_state_dict(state[name])


def check_loss_terms(task, terms: dict) -> None:
    """A training step's dict holds the loss under "loss" and names no extra term as a loop scalar
    (it would be logged over it): one-line errors, at the first step."""
    target = f"task._target_={type(task).__module__}.{type(task).__qualname__}"
    if "loss" not in terms:
        raise ConfigError(f"{target}: training_step returned a dict without \"loss\" (keys {sorted(terms)}); put the "
                          "loss to back-propagate under \"loss\", extra terms beside it (docs/tasks.md)")
    if clashes := sorted(LOOP_SCALARS & terms.keys() - {"loss"}):
        raise ConfigError(f"{target}: training_step's extra term(s) {clashes} would be logged over the loop's own "
                          f"train/<name> scalars ({', '.join(sorted(LOOP_SCALARS))}); rename them")


def local_bytes(tensors) -> int:
    """The bytes of `tensors` on this rank (a DTensor's local shard only)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def _bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model


def parameters_finite(model: nn.Module) -> torch.Tensor:
    """A device flag (int32 0/1): every parameter and buffer of `model` (this rank's shards, under FSDP) is finite."""
    flags = [torch.isfinite(local_tensor(t)).all() for t in model.state_dict().values() if t.is_floating_point()]
    return torch.stack(flags).all().to(torch.int32) if flags else torch.ones((), dtype=torch.int32)
