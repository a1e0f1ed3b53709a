"""Semantic segmentation: cross-entropy over pixels (plus 0.5 x an auxiliary head's, as torchvision's
references/segmentation), and pixel accuracy, per-class IoU and mIoU from a confusion matrix.

Evaluation sums, one float64 tensor of 2 + num_classes**2 values per batch:
    [0]   the cross-entropy of `out`, summed over the counted (non-ignored) pixels
    [1]   the number of images
    [2:]  the confusion matrix, row-major: entry t * num_classes + p counts pixels of target class t
          predicted as p (torch.bincount(n * target[k] + pred[k], minlength=n * n), k the counted pixels)
Every entry is a sum over pixels or images, so the sums of any split of the data add up to the sums
of the whole: summing over batches and ranks (one all_reduce) is exact at any world size, and padding
(masks at ignore_index) counts for nothing. float64 counts are exact up to 2**53 pixels."""

import math

import torch
from torch.nn import functional as F

from data.segmentation_transforms import IGNORE_INDEX
HEADER = 2  # loss sum and image count, before the confusion matrix


def _logits(output) -> torch.Tensor:
    return output["out"] if isinstance(output, dict) else output


def segmentation_loss(output, target: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                      aux_weight: float = 0.5) -> torch.Tensor:
    """Mean cross-entropy over the batch's counted pixels of `out`, plus aux_weight x that of `aux` where
    the model has an auxiliary head. `output` is the model's dict (or the `out` logits, N x C x H x W);
    target is N x H x W class ids, ignore_index where a pixel counts for nothing."""
    loss = F.cross_entropy(_logits(output), target, ignore_index=ignore_index)
    if isinstance(output, dict) and output.get("aux") is not None:
        loss = loss + aux_weight * F.cross_entropy(output["aux"], target, ignore_index=ignore_index)
    return loss


def confusion_sums(output, target: torch.Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This batch's evaluation sums (layout in the module docstring), on the logits' device. Only `out`
    counts, as the reference evaluates. Without a host sync: ignored pixels go to an extra bin that is
    dropped, instead of being masked out (boolean indexing would wait for the device)."""
    logits = _logits(output)
    counted = target != ignore_index
    bins = torch.where(counted, target * num_classes + logits.argmax(dim=1), num_classes * num_classes)
    counts = torch.zeros(num_classes * num_classes + 1, dtype=torch.float64, device=logits.device)
    counts.index_add_(0, bins.flatten(), torch.ones(bins.numel(), dtype=torch.float64, device=logits.device))
    loss_sum = F.cross_entropy(logits.double(), target, ignore_index=ignore_index, reduction="sum")
    image_count = torch.tensor([len(target)], dtype=torch.float64, device=logits.device)
    return torch.cat([loss_sum.reshape(1), image_count, counts[:-1]])


def segmentation_metrics(sums: torch.Tensor, class_names: list[str] | None = None) -> dict[str, float]:
    """From evaluation sums added up over every batch and rank: `loss` (mean cross-entropy per counted
    pixel), `pixel_accuracy`, `miou`, `iou/<class>` per class, and `samples` (images).

    IoU of a class is diag / (row + column - diag). A class in neither the targets nor the predictions
    has no IoU (NaN): it is left out of mIoU, which is the mean over the classes that occur. (torchvision's
    reference takes the plain mean, so one absent class makes its mIoU NaN.)"""
    sums = sums.detach().double().cpu()
    num_classes = math.isqrt(len(sums) - HEADER)
    if num_classes * num_classes != len(sums) - HEADER:
        raise ValueError(f"evaluation sums of length {len(sums)} are not {HEADER} + num_classes**2")
    names = class_names if class_names is not None else [str(index) for index in range(num_classes)]
    if len(names) != num_classes:
        raise ValueError(f"{len(names)} class names for {num_classes} classes")
    confusion = sums[HEADER:].reshape(num_classes, num_classes)
    diag, pixels = confusion.diag(), confusion.sum()
    union = confusion.sum(0) + confusion.sum(1) - diag
    iou = torch.where(union > 0, diag / union, torch.nan)
    return {
        "loss": (sums[0] / pixels).item(),
        "pixel_accuracy": (diag.sum() / pixels).item(),
        "miou": iou.nanmean().item(),
        **{f"iou/{name}": value for name, value in zip(names, iou.tolist())},
        "samples": int(sums[1].item()),
    }
