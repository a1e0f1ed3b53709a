"""How long a training run is, in the units its loop counts: micro-batches, updates, epochs."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingLength:
    """How long the run is, in the units the loop counts."""

    batches_per_epoch: int  # micro-batches of this rank per epoch (all ranks have the same number)
    accumulate: int  # micro-batches per optimizer update
    updates_per_epoch: int
    total_updates: int  # trainer.max_epochs of them, or trainer.max_steps if that ends first (the schedule's length)
    # The loop ends after trainer.max_epochs, or at this step: not at total_updates, since a run
    # resumed at another world size has counted some of its updates in another global batch.
    max_steps: float  # trainer.max_steps, or inf
    global_batch: int  # samples per update over all ranks
    samples_per_batch: int  # samples of one micro-batch over all ranks: batch_size x world_size

    @property
    def epochs(self) -> int:
        """The epochs the run trains in: trainer.max_epochs, or fewer where trainer.max_steps ends it."""
        return math.ceil(self.total_updates / self.updates_per_epoch)

    @classmethod
    def of(cls, trainer_cfg, train_size: int, batch_size: int, world_size: int) -> "TrainingLength":
        batches = math.ceil(math.ceil(train_size / world_size) / batch_size)  # DistributedSampler pads to equal shares
        if trainer_cfg.limit_train_batches != -1:
            batches = min(batches, trainer_cfg.limit_train_batches)
        accumulate = trainer_cfg.accumulate_grad_batches
        if trainer_cfg.global_batch_size is not None:  # the same global batch at any world size (validate: it divides)
            accumulate = trainer_cfg.global_batch_size // (batch_size * world_size)
        updates_per_epoch = math.ceil(batches / accumulate)
        total = updates_per_epoch * trainer_cfg.max_epochs
        if trainer_cfg.max_steps != -1:
            total = min(total, trainer_cfg.max_steps)
        max_steps = trainer_cfg.max_steps if trainer_cfg.max_steps != -1 else math.inf
        return cls(batches, accumulate, updates_per_epoch, total, max_steps, batch_size * world_size * accumulate,
                   batch_size * world_size)
