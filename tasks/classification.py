"""Image classification: (label-smoothed) cross-entropy, MixUp/CutMix on training batches, and the
mean loss and top-1 accuracy over a split.

Evaluation sums, one float64 tensor of 3 values per batch: [cross-entropy summed over the samples,
correctly classified samples, samples]. Every entry is a sum over samples, so summing over batches
and ranks (one all_reduce) is exact at any world size."""

import torch
from torch.nn import functional as F

from data.mix import build_batch_mix
from tasks import Task


class ClassificationTask(Task):
    def __init__(self, num_classes: int | None = None, *, label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, class_names: list[str] | None = None):
        self.label_smoothing = label_smoothing
        self.class_names = class_names
        # (images, labels) -> (images, soft targets); None without mixing (num_classes is needed only with it)
        self.batch_mix = build_batch_mix(mixup_alpha, cutmix_alpha, num_classes)

    def train_batch(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_mix is None:
            return images, targets
        return self.batch_mix(images, targets)  # soft targets: class probabilities

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Against hard labels or soft (mixed) targets alike."""
        return F.cross_entropy(output, targets, label_smoothing=self.label_smoothing)

    def eval_sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Without label smoothing: the loss reported is the plain cross-entropy, at any training setting."""
        sums = torch.zeros(3, dtype=torch.float64, device=output.device)
        sums[0] += F.cross_entropy(output, targets, reduction="sum")
        sums[1] += (output.argmax(dim=1) == targets).sum()
        sums[2] += len(targets)
        return sums

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, correct, count = sums.tolist()
        return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}
