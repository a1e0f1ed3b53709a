"""Tasks: what a model is trained for. A task owns everything the loop must not name: its training
step (by default the loss of the model's output, after the training-only batch transforms), its
evaluation step and statistics, the metrics computed from them, the metric a sweep optimises and its
direction, the trainable heads it puts around the model, the modules it uses without training them
(a teacher), and its TensorBoard extras. Pick one with `task=<name>` (conf/task/<name>.yaml); the
recipe builds it once per run with build_task, as a model or a dataset:
`_target_(num_classes=..., class_names=..., **options)` (and `in_channels=...` where its constructor
has that parameter), the options being the yaml's other keys, checked against `_target_`'s own
signature (ddp.config.builder_options). Two keys of the yaml are the run's, not the task's, and the
task object doesn't see them:

    task.objective    the results key `main` returns and a sweep optimises, e.g. val_accuracy
    task.direction    maximize | minimize: the objective's direction (Optuna's, via ${task.direction})

A task subclasses Task. For `loss(model(images), targets)` it defines loss, eval_sums and metrics
(tasks/classification.py is the reference); the other members have defaults, and a task overrides
those it needs (tasks/distillation.py, tasks/simclr.py). docs/tasks.md documents each member.
"""

import inspect
from typing import Any

import torch
from hydra._internal.utils import _locate
from torch import nn

from ddp.config.builder_options import builder_options, instantiate_checked
from ddp.config.schema import ConfigError
from ddp.loading.batches import images_and_labels


class Task:
    """The interface, with the defaults of a task that trains `loss(model(images), targets)`."""

    views = 1  # augmented views per training sample that training_step takes (data.views must match)
    # True: evaluation gathers per-sample records instead of summing (tasks/detection.py): eval_step returns
    # (sums, records), and metrics(sums, records, dataset) scores every rank's records, once, on rank 0
    gathers_predictions = False

    def train_batch(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-only batch transforms on the device, before the forward (MixUp/CutMix give soft
        targets); the batch unchanged when there are none."""
        return images, targets

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The scalar mean loss of this micro-batch, differentiable. `output` is model(images) as the
        model returns it (a dict {"out", "aux"} for torchvision's segmentation models)."""
        raise NotImplementedError(f"{type(self).__name__}: define loss, or a training_step of its own")

    def eval_sums(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """A 1-D float64 tensor of sums over this batch's samples, on the output's device, of one fixed
        length for the whole run, computed without a host sync. Sums add up: summed over batches and
        then over ranks (one all_reduce) they are exactly the sums of the whole split, at any world size."""
        raise NotImplementedError(f"{type(self).__name__}: define eval_sums, or an eval_step of its own")

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """The metrics from the summed sums, keys without a split prefix; must include "loss" and
        "samples". evaluate() prefixes "val_" (mode=eval renames it to the split's, EMA weights get "val_ema_")."""
        raise NotImplementedError(f"{type(self).__name__}: define metrics")

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """The loss of one training micro-batch: a scalar tensor, or a dict with the "loss" and named
        extra terms (logged as train/<name> at log steps; only "loss" is back-propagated). `model` is
        the model as wrapped (DDP, DataParallel, FSDP or bare), `batch` the loader's batch on the device.
        Runs under the run's autocast, and inside DDP's no_sync on all but a group's last micro-batch;
        the update step divides the loss by the group size, backpropagates it and steps."""
        images, targets = self.transformed_batch(batch)
        return self.loss(model(images), targets)

    def transformed_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's images and targets (an (images, targets) pair, or a dict's "image" and "label":
        images_and_labels) through train_batch, the images kept in their memory layout (channels_last),
        which a transform may change: for training steps of that batch shape."""
        images, targets = images_and_labels(batch)
        transformed, targets = self.train_batch(images, targets)
        if images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last):
            transformed = transformed.contiguous(memory_format=torch.channels_last)
        return transformed, targets

    def eval_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """This validation batch's sums (as eval_sums describes them), under no_grad, `model` in eval mode;
        the batch as transformed_batch reads it."""
        images, targets = images_and_labels(batch)
        return self.eval_sums(model(images), targets)

    def with_heads(self, backbone: nn.Module) -> nn.Module:
        """The trainable model: `backbone` (the model= config's) with the task's trainable heads as
        submodules, or the backbone alone. What this returns is wrapped, trained, checkpointed, exported,
        evaluated by mode=eval, and loaded by model.weights_path."""
        if is_detector(backbone):
            raise ConfigError(f"model: a detector trains with task=detection, not with {type(self).__name__}; "
                              "set task=detection, or use a model of this task")
        return backbone

    def frozen_modules(self) -> dict[str, nn.Module]:
        """Modules the task uses but does not train (a teacher), keyed by the config key that names
        them (e.g. "task.teacher"). The recipe puts them on the device, in eval mode, requires_grad off;
        they are never wrapped, in the optimizer, the EMA or the checkpoint, which records a fingerprint
        of each so that a resume with another one is refused."""
        return {}

    def baselines(self) -> dict[str, nn.Module]:
        """Frozen models evaluated once at the start like the model (eval_step), reported as
        <name>_val_<metric> in results.json and the log (e.g. teacher_val_accuracy)."""
        return {}

    def log_validation(self, writer, model: nn.Module, dataset, device: torch.device, step: int) -> None:
        """TensorBoard extras after each validation. Called on every rank with the bare model in eval
        mode; the writer does nothing off rank 0, so work only where it is active, and run no collective."""


def is_detector(model: nn.Module) -> bool:
    """A torchvision detector (models/detection.py), which resizes and batches its images itself. By its
    transform's class name: no import of torchvision's detection models for the tasks that need none."""
    return type(getattr(model, "transform", None)).__name__ == "GeneralizedRCNNTransform"


def build_task(task_cfg, num_classes: int, class_names: list[str] | None, in_channels: int | None = None,
               views: int | None = 1) -> Task:
    """Call task._target_ with the data's num_classes and class_names (None where it names none), its
    in_channels where the constructor takes them, and its options; the data's views (per training
    sample, data.views) must be the task's. `views` None: nothing trains (mode=eval), so none are checked."""
    options = builder_options(task_cfg, "task")
    data = {"num_classes": num_classes, "class_names": class_names}
    if "in_channels" in inspect.signature(_locate(options["_target_"])).parameters:
        data["in_channels"] = in_channels
    task = instantiate_checked(options, "task", **data)
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={options['_target_']}: not a task; subclass tasks.Task (docs/tasks.md)")
    if views is not None and views != task.views:
        raise ConfigError(f"data.views={views}: {type(task).__name__} trains on {task.views} view(s) of each sample; "
                          f"set data.views={task.views}")
    return task
