"""How long a training run is, in the units its loop counts (micro-batches, updates, epochs), and
where it stands: the loop's progress, which a checkpoint stores."""

import math
from dataclasses import dataclass, field

import torch


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
    train_size: int  # the training split's samples (an epoch's, over all ranks)

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
                   batch_size * world_size, train_size)


@dataclass
class Position:
    """Where training stands; a checkpoint stores it, and a resumed run continues from it.

    Within an epoch the checkpoint holds the global samples trained: the epoch's shuffled order is
    the same at any world size (ddp/loading/samplers.py), so a resume at another world size continues it
    exactly. The loop counts the epoch's batches on a grid that begins at sample `epoch_start`.
    """

    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch's grid already trained (by every rank)
    global_step: int = 0
    epoch_start: int = 0  # the grid's first sample of the epoch: 0 unless resumed at another world size
    # this rank's loss sum and sample count so far in `epoch` (float64, kept on the training device)
    epoch_totals: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))

    def samples_in_epoch(self, samples_per_batch: int, train_size: int) -> int:
        """Samples of the epoch's global order trained; `samples_per_batch`: batch_size x world_size.
        The epoch's last batch may be partial, or pad the ranks' shares: once it is trained, all
        `train_size` are, not a full batch more."""
        return min(self.epoch_start + self.batch_in_epoch * samples_per_batch, train_size)
