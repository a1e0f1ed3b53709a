"""Knowledge distillation (Hinton et al., 2015): a student, the model= config's model, learns from the
labels and from a frozen teacher's logits. timm's LogitDistillationTask is the same loss.

    loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

T^2 keeps the soft term's gradients on the scale of the hard term's as T grows. The teacher is one of
our checkpoints (task.teacher) or a model config of its own (task.teacher_model, any model= option);
the task holds it as a frozen module (Task.frozen_modules): on the device, in eval mode, never wrapped,
trained or checkpointed, and fingerprinted in the checkpoint, so a resume with another teacher is
refused. Evaluation is classification's: the student's loss and accuracy; the teacher's are measured
once at the start (Task.baselines: teacher_val_accuracy). docs/distillation.md is the user's page."""

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn import functional as F

from ddp.checkpoints.checkpoint import CheckpointError, is_sharded_checkpoint, load_checkpoint, load_latest_checkpoint
from ddp.config.schema import ConfigError
from ddp.training.update import AUTOCAST_DTYPES
from models import build_model
from models.weights import read_state_dict, strip_wrapper_prefixes
from tasks.classification import ClassificationTask

log = logging.getLogger(__name__)


class DistillationTask(ClassificationTask):
    """Classification's batch mixing (MixUp/CutMix: the teacher sees the mixed images, and the hard
    term takes the soft targets), loss against the labels, evaluation and metrics; plus the teacher."""

    def __init__(self, num_classes: int, in_channels: int, *, teacher: str | None = None,
                 teacher_model: dict | str | None = None, alpha: float = 0.5, temperature: float = 4.0,
                 precision: str = "32", label_smoothing: float = 0.0, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 class_names: list[str] | None = None):
        if not 0 <= alpha <= 1:
            raise ConfigError(f"task.alpha={alpha}: out of range; use a weight in [0, 1] (0: labels only, 1: teacher only)")
        if not temperature > 0:
            raise ConfigError(f"task.temperature={temperature}: out of range; use a temperature > 0 (Hinton et al. use 1 to 20)")
        super().__init__(num_classes, label_smoothing=label_smoothing, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                         class_names=class_names)
        self.alpha, self.temperature = alpha, temperature
        # Under strategy=fsdp the update step doesn't autocast (FSDP's policy casts the student): the
        # teacher then autocasts itself, so it computes at the run's precision on every strategy.
        self.teacher_autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self.teacher = build_teacher(teacher, teacher_model, num_classes, in_channels)

    def training_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """The student's and the teacher's forward of the same (mixed) images; loss and its two terms."""
        mixed, targets = self.transformed_batch(batch)
        student_logits = model(mixed)
        teacher_logits = self.teacher_logits(mixed)
        task_loss = self.loss(student_logits, targets)
        kd_loss = distillation_loss(student_logits, teacher_logits, self.temperature)
        return {"loss": (1 - self.alpha) * task_loss + self.alpha * kd_loss, "task_loss": task_loss, "kd_loss": kd_loss}

    @torch.no_grad()
    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Under the run's autocast where the update step opened one, else under the run's precision."""
        device_type = images.device.type
        if self.teacher_autocast_dtype is None or torch.is_autocast_enabled(device_type):
            return self.teacher(images)  # an autocast(enabled=False) here would switch the run's off
        with torch.autocast(device_type, dtype=self.teacher_autocast_dtype):
            return self.teacher(images)

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {"task.teacher": self.teacher}

    def baselines(self) -> dict[str, nn.Module]:
        return {"teacher": self.teacher}


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch, in float32."""
    student_log_probs = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(student_log_probs, teacher_log_probs, reduction="batchmean", log_target=True) * temperature**2


def build_teacher(teacher: str | None, teacher_model: dict | str | None, num_classes: int, in_channels: int) -> nn.Module:
    """The teacher from exactly one of task.teacher and task.teacher_model, its weights loaded strictly:
    every tensor of its model from the file (a classifier for other classes is refused, not replaced by a
    fresh one as model.weights_path does). Built without drawing from the global RNG, so the student
    starts from the same weights as with task=classification at the same seed."""
    if (teacher is None) == (teacher_model is None):
        given = "both are set" if teacher is not None else "neither is set"
        raise ConfigError(f"task.teacher, task.teacher_model: {given}; name the teacher with exactly one: "
                          "task.teacher=<checkpoint or run dir>, or model@task.teacher_model=<model option>")
    if teacher is not None:
        model_cfg, state, source = teacher_checkpoint(teacher)
    else:
        model_cfg, state, source = teacher_config(teacher_model)
    with torch.random.fork_rng(devices=[]):
        model = build_model({**model_cfg, "weights_path": None}, num_classes, in_channels)
    if state is None:
        log.warning("%s has no weights_path: the teacher is randomly initialised", source)
        return model
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    reshaped = sorted(key for key in own.keys() & state.keys() if own[key].shape != state[key].shape)
    if missing or unexpected or reshaped:
        found = ", ".join(f"{len(keys)} {kind} {keys[:3]}" for keys, kind in
                          ((missing, "missing"), (unexpected, "unexpected"), (reshaped, "reshaped")) if keys)
        raise ConfigError(f"{source}: its weights don't fit its model built for this data (num_classes={num_classes}, "
                          f"in_channels={in_channels}): {found}; distil on the data and classes the teacher was trained on")
    model.load_state_dict(state, strict=True)
    return model


def teacher_checkpoint(teacher: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """task.teacher: a run dir (its newest checkpoint, as resume=<run dir> finds it), a checkpoint file, or
    a sharded checkpoint's dir (read whole, as mode=eval and the export do). Its model config and weights
    (the model's, not the EMA's), and where they came from."""
    path = Path(teacher)
    try:
        if path.is_dir() and not is_sharded_checkpoint(path):
            found = load_latest_checkpoint(path)
            if found is None:
                raise ConfigError(f"task.teacher={teacher}: no loadable checkpoint in {path / 'checkpoints'}; "
                                  "name a run dir, a checkpoint file or a sharded checkpoint's dir")
            path, checkpoint = found
        else:
            checkpoint = load_checkpoint(path)
        state = checkpoint.get("model")
        if checkpoint.get("sharded"):
            from ddp.checkpoints.sharded_checkpoint import full_model_state  # DCP, imported where it's used

            state = full_model_state(path)
    except CheckpointError as error:
        raise ConfigError(f"task.teacher={teacher}: {error}") from None
    return checkpoint["config"]["model"], state, f"task.teacher={path}"


def teacher_config(teacher_model: dict | str) -> tuple[dict, dict[str, torch.Tensor] | None, str]:
    """task.teacher_model: a model config (any model= option's keys, selected with
    model@task.teacher_model=<option>), its weights_path's tensors (None without one), and its key."""
    if isinstance(teacher_model, str):
        raise ConfigError(f"task.teacher_model={teacher_model}: a model config, not a name; pick a model option with "
                          f"model@task.teacher_model={teacher_model}")
    model_cfg = OmegaConf.to_container(teacher_model, resolve=True) if isinstance(teacher_model, DictConfig) else dict(teacher_model)
    weights_path = model_cfg.get("weights_path")
    if weights_path is None:
        return model_cfg, None, "task.teacher_model"
    try:
        state = read_state_dict(Path(weights_path))
    except ConfigError as error:
        raise ConfigError(f"task.teacher_model: {error}") from None
    return model_cfg, {strip_wrapper_prefixes(key): value for key, value in state.items()}, \
        f"task.teacher_model.weights_path={weights_path}"
