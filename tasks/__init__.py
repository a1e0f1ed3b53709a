"""Tasks: what a model is trained for. A task owns everything the loop must not name: the loss, the
training-only batch transforms, the evaluation statistics, the metrics computed from them, the metric
a sweep optimises and its direction, and its TensorBoard extras. Pick one with `task=<name>`
(conf/task/<name>.yaml); the recipe builds it once per run with build_task, as a model or a dataset:
`_target_(num_classes=..., class_names=..., **options)`, the options being the yaml's other keys,
checked against `_target_`'s own signature (ddp.config.builder_options). Two keys of the yaml are
the run's, not the task's, and the task object doesn't see them:

    task.objective    the results key `main` returns and a sweep optimises, e.g. val_accuracy
    task.direction    maximize | minimize: the objective's direction (Optuna's, via ${task.direction})

A task is any object with these members (duck-typed; tasks/classification.py is the reference):

    train_batch(images, targets) -> (images, targets)
        Training-only batch transforms on the device, before the forward (MixUp/CutMix give soft
        targets); the batch unchanged when there are none.
    loss(output, targets) -> Tensor
        The scalar mean loss of this micro-batch, differentiable. `output` is model(images) as the
        model returns it (a dict {"out", "aux"} for torchvision's segmentation models).
    eval_sums(output, targets) -> Tensor
        A 1-D float64 tensor of sums over this batch's samples, on the output's device, of one fixed
        length for the whole run, computed without a host sync. Sums add up: summed over batches and
        then over ranks (one all_reduce) they are exactly the sums of the whole split, at any world size.
    metrics(sums) -> dict[str, float]
        The metrics from the summed sums, keys without a split prefix; must include "loss" and
        "samples". evaluate() prefixes "val_" (mode=eval renames it to the split's, EMA weights get "val_ema_").
    log_validation(writer, model, dataset, device, step) -> None
        TensorBoard extras after each validation. Called on every rank with the bare model in eval
        mode; the writer does nothing off rank 0, so work only where it is active, and run no collective.
"""

from ddp.config.builder_options import builder_options, instantiate_checked


def build_task(task_cfg, num_classes: int, class_names: list[str] | None):
    """Call task._target_ with the data's num_classes and class_names (None where it names none) and its options."""
    return instantiate_checked(builder_options(task_cfg, "task"), "task", num_classes=num_classes, class_names=class_names)
