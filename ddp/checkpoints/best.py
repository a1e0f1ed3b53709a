"""The best validation so far: which steps' checkpoints to keep as best-<step>.pt, what results.json
and TensorBoard report as best, and when to stop early.

Every rank keeps the same record and takes the same decisions (keep this step, stop now) at the same
step, with no collective of its own: a validation's metrics are the task's `metrics` of the sums that
evaluate()'s one all_reduce leaves bitwise identical on every rank (torch.distributed.all_reduce's
documented guarantee), and a task's metrics are a function of those sums alone (tasks/__init__.py).
The record goes into every checkpoint (`state_dict`), so a resumed run keeps its best, its kept files
and its patience count.
"""

import difflib
import logging
import math

import torch

from ddp.config.schema import ConfigError
from ddp.loading.batches import one_sample_batch

log = logging.getLogger("train")  # the run's own console lines, under the script's name


def ranked_metric(objective: str, best_of: str) -> str:
    """The results key that ranks validations: the task's objective, of the EMA weights with best_of=ema."""
    return objective.replace("val_", "val_ema_", 1) if best_of == "ema" else objective


def objective_key(objective: str, trainer_objective: str, best_of: str, mode: str = "train", split: str = "val") -> str:
    """The results key `main` returns and a sweep ranks: the final objective, or its best (trainer.objective);
    in mode=eval, the objective of the split evaluated."""
    if mode == "eval":
        return objective.replace("val_", f"{split}_", 1)
    return "best_" + ranked_metric(objective, best_of) if trainer_objective == "best" else objective


def check_validations(*, keep_best: int, patience: int | None, trainer_objective: str, val_every_n_epochs: int,
                      run_epochs: int) -> None:
    """Keeping the best, early stopping and objective=best compare validations: the run must have more than its final one."""
    wanted = [setting for setting, on in ((f"checkpoint.keep_best={keep_best}", keep_best > 0),
                                          (f"trainer.early_stop_patience={patience}", patience is not None),
                                          ("trainer.objective=best", trainer_objective == "best")) if on]
    if wanted and val_every_n_epochs > run_epochs:
        raise ConfigError(f"trainer.val_every_n_epochs={val_every_n_epochs} is larger than the run ({run_epochs} epochs): only "
                          f"the final validation happens, so {', '.join(wanted)} has nothing to compare; lower "
                          "trainer.val_every_n_epochs, or set checkpoint.keep_best=0 (and no early stopping, trainer.objective=final)")


@torch.no_grad()
def check_metric_name(metric: str, key: str, task, model: torch.nn.Module, val_split) -> None:
    """`metric` must be a key of the task's validation results: a batch of val_split's first sample through
    the model shows them (for a task that gathers predictions, the metrics of that sample's)."""
    was_training = model.training
    sums = task.eval_step(model.eval(), one_sample_batch(val_split))
    model.train(was_training)
    metrics = task.metrics(*sums, val_split) if task.gathers_predictions else task.metrics(sums)
    names = [name for name in ("val_" + k for k in metrics) if name != "val_samples"]
    if metric not in names:
        closest = difflib.get_close_matches(metric, names, n=1)
        hint = f"did you mean {closest[0]}? " if closest else ""
        raise ConfigError(f"{key}={metric}: not a validation metric of this task ({hint}metrics: {', '.join(names)})")


def check_best_settings(checkpoint_cfg, trainer_cfg, task_cfg, *, run_epochs: int, task, model: torch.nn.Module,
                        val_split, resumed: tuple | None) -> None:
    """checkpoint.keep_best, best_of, trainer.early_stop_patience and trainer.objective against this run and
    the checkpoint it resumes (`resumed`: path, checkpoint), before anything starts."""
    if resumed:
        check_record_fits(resumed[1], ranked_metric(task_cfg.objective, checkpoint_cfg.best_of), task_cfg.direction,
                          resumed[0])
    check_validations(keep_best=checkpoint_cfg.keep_best, patience=trainer_cfg.early_stop_patience,
                      trainer_objective=trainer_cfg.objective, val_every_n_epochs=trainer_cfg.val_every_n_epochs,
                      run_epochs=run_epochs)
    check_metric_name(task_cfg.objective, "task.objective", task, model, val_split)


def check_record_fits(checkpoint: dict, metric: str, direction: str, source) -> None:
    """A resumed run goes on with its checkpoint's record of the best (best value, kept files, patience
    count), so it must rank validations as that run did: another metric or direction is refused, not
    mixed into the record. A new run from the same weights starts a record of its own."""
    record = checkpoint.get("best")
    if record is None:  # a checkpoint from before the record: the record starts afresh
        return
    recorded = (record["metric"], record.get("direction", direction))  # no direction: saved before it was recorded
    if recorded != (metric, direction):
        raise ConfigError(f"resume: {source} ranked its validations by {recorded[0]} ({recorded[1]}), this run would by "
                          f"{metric} ({direction}): resume with the task.objective, task.direction and checkpoint.best_of "
                          f"it was trained with, or start a new run from its weights with model.weights_path={source}")


class BestTracker:
    """The best validation by `metric` in `direction`, the `keep_best` best steps (their checkpoints are
    best-<step>.pt), and early stopping: after `patience` validations in a row without an improvement
    larger than `min_delta` over the best that last reset the count, the run stops (None: never)."""

    def __init__(self, *, metric: str, direction: str, keep_best: int, patience: int | None, min_delta: float,
                 max_epochs: int):
        self.metric, self.maximize, self.keep_best = metric, direction == "maximize", keep_best
        self.patience, self.min_delta, self.max_epochs = patience, min_delta, max_epochs
        self.best: dict | None = None  # {"value", "step", "epoch", "metrics"} of the best validation
        self.kept: list[list] = []  # [value, step] of the kept best-<step>.pt, best first
        self.reference: float | None = None  # the value that last reset the patience count
        self.validations_without_improvement = 0
        self.stopped: dict | None = None  # {"epoch", "step", "reason"} once it stopped early
        self.save_step = -1  # a validation at this step entered the kept ones: its checkpoint is kept as best

    def _better(self, value: float, than: float, by: float = 0.0) -> bool:
        return value - than > by if self.maximize else than - value > by

    def update(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        """After a validation at `step` (every rank, the same step: a collective)."""
        value = metrics[self.metric]
        if math.isnan(value):
            value = -math.inf if self.maximize else math.inf  # never the best
        if self.best is None or self._better(value, self.best["value"]):
            self.best = {"value": value, "step": step, "epoch": epoch,
                         "metrics": {key: v for key, v in metrics.items() if key.startswith("val_") and key != "val_samples"}}
        if self.keep_best and (len(self.kept) < self.keep_best or self._better(value, self.kept[-1][0])):
            # a tie ranks after the kept ones: the earlier step stays the best
            self.kept = sorted([*self.kept, [value, step]], key=lambda kept: -kept[0] if self.maximize else kept[0])[:self.keep_best]
            self.save_step = step
        if self.reference is None or self._better(value, self.reference, self.min_delta):
            self.reference, self.validations_without_improvement = value, 0
        else:
            self.validations_without_improvement += 1
        if self.patience is not None and self.validations_without_improvement >= self.patience:
            reason = (f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} validations "
                      f"(best {self.best['value']:.4f} at step {self.best['step']})")
            self.stopped = {"epoch": epoch, "step": step, "reason": reason}
            log.info("stopped early at epoch %d, step %d: %s", epoch, step, reason)

    @property
    def stop(self) -> bool:
        return self.stopped is not None

    def kept_steps(self) -> list[int]:
        """The steps of the kept best checkpoints, best first."""
        return [step for _, step in self.kept]

    def results(self) -> dict:
        """results.json's best_* keys, and whether (and why) the run stopped early."""
        best = self.best or {"step": None, "epoch": None, "metrics": {}}
        return {
            "best_metric": self.metric,
            "best_step": best["step"],
            "best_epoch": best["epoch"],
            **{f"best_{key}": value for key, value in best["metrics"].items()},
            "stopped_early": self.stop,
            "stopped_epoch": self.stopped["epoch"] if self.stopped else None,
            "stop_reason": self.stopped["reason"] if self.stopped else None,
        }

    def state_dict(self) -> dict:
        """Plain containers, for the checkpoint."""
        return {"metric": self.metric, "direction": "maximize" if self.maximize else "minimize", "best": self.best,
                "kept": self.kept, "reference": self.reference,
                "validations_without_improvement": self.validations_without_improvement, "stopped": self.stopped,
                "max_epochs": self.max_epochs}

    @classmethod
    def of(cls, checkpoint_cfg, trainer_cfg, task_cfg, checkpoint: dict | None) -> "BestTracker":
        """The run's tracker; a resumed run (`checkpoint`) keeps its record and its patience count."""
        tracker = cls(metric=ranked_metric(task_cfg.objective, checkpoint_cfg.best_of), direction=task_cfg.direction,
                      keep_best=checkpoint_cfg.keep_best, patience=trainer_cfg.early_stop_patience,
                      min_delta=trainer_cfg.early_stop_min_delta, max_epochs=trainer_cfg.max_epochs)
        if checkpoint is not None:
            tracker.load_state_dict(checkpoint.get("best"))
        return tracker

    def load_state_dict(self, state: dict | None) -> None:
        """A resumed run's record. A run that stopped early stays stopped unless trainer.early_stop_patience
        or trainer.max_epochs grew; the patience count goes on where it was."""
        if state is None:  # a checkpoint from before the record: start it afresh
            return
        self.best, self.kept, self.reference = state["best"], state["kept"], state["reference"]
        self.validations_without_improvement, self.stopped = state["validations_without_improvement"], state["stopped"]
        if self.keep_best < len(self.kept):
            self.kept = self.kept[:self.keep_best]
        patience_grew = self.patience is None or self.validations_without_improvement < self.patience
        if self.stopped and (patience_grew or self.max_epochs > state["max_epochs"]):
            self.stopped = None
        elif self.stopped:
            log.info("the run stopped early at epoch %d (%s): nothing more to train", self.stopped["epoch"], self.stopped["reason"])
