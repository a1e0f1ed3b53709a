"""Semantic segmentation: cross-entropy over pixels (plus 0.5 x an auxiliary head's, as torchvision's
references/segmentation), and pixel accuracy, per-class IoU and mIoU from a confusion matrix.

Evaluation sums, one float64 tensor of 2 + num_classes**2 values per batch:
    [0]   the cross-entropy of `out`, summed over the counted (non-ignored) pixels
    [1]   the number of images
    [2:]  the confusion matrix, row-major: entry t * num_classes + p counts pixels of target class t
          predicted as p (torch.bincount(n * target[k] + pred[k], minlength=n * n), k the counted pixels)
Every entry is a sum over pixels or images, so the sums of any split of the data add up to the sums
of the whole: summing over batches and ranks (one all_reduce) is exact at any world size, and padding
(masks at ignore_index) counts for nothing. float64 counts are exact up to 2**53 pixels.

SegmentationTask (task=segmentation) puts these behind the task interface (tasks/__init__.py)."""

import math

import torch
from torch.nn import functional as F

from torchvision.utils import make_grid

from data.segmentation_transforms import IGNORE_INDEX
from ddp.config.schema import ConfigError
from ddp.distributed.dtensor import is_sharded
from ddp.loading.batches import images_and_labels
from tasks import Task

HEADER = 2  # loss sum and image count, before the confusion matrix


def _logits(output) -> torch.Tensor:
    return output["out"] if isinstance(output, dict) else output


def segmentation_loss(output, target: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                      aux_weight: float = 0.5) -> torch.Tensor:
    """Mean cross-entropy over the batch's counted pixels of `out`, plus aux_weight x that of `aux` where
    the model has an auxiliary head. `output` is the model's dict (or the `out` logits, N x C x H x W);
    target is N x H x W class ids, ignore_index where a pixel counts for nothing.

    A batch without a counted pixel (all its masks ignore_index) has loss 0, not the NaN of a mean over
    nothing, which the non-finite guard would take for divergence. It still backpropagates through every
    logit (zero gradients), so every parameter gets its gradient and DDP's ranks stay in step. Any other
    batch's loss and gradients equal F.cross_entropy's mean bit for bit (a sum divided by the same count).
    The count stays on the device: no host sync."""
    pixels = (target != ignore_index).sum().clamp(min=1)
    loss = F.cross_entropy(_logits(output), target, ignore_index=ignore_index, reduction="sum") / pixels
    if isinstance(output, dict) and output.get("aux") is not None:
        loss = loss + aux_weight * (F.cross_entropy(output["aux"], target, ignore_index=ignore_index, reduction="sum") / pixels)
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


# Mask colours for the TensorBoard images: class c gets Pascal VOC's colour for c (fixed, and distinct
# for every c < 256), ignored pixels white, which VOC's map gives to no index below 256.
def _voc_colour(index: int) -> list[int]:
    colour = [0, 0, 0]
    for bit in range(8):
        for channel in range(3):
            colour[channel] |= ((index >> (3 * bit + channel)) & 1) << (7 - bit)
    return colour


PALETTE = torch.tensor([_voc_colour(index) for index in range(256)], dtype=torch.float32) / 255
IGNORE_COLOUR = torch.ones(3)


def colourise(mask: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """An H x W mask of class ids (or ignore_index) as a 3 x H x W image in [0, 1]."""
    counted = mask != ignore_index
    colours = PALETTE[torch.where(counted, mask, 0).clamp(max=len(PALETTE) - 1).cpu()]
    return torch.where(counted.cpu()[..., None], colours, IGNORE_COLOUR).permute(2, 0, 1)


def _rescaled(image: torch.Tensor) -> torch.Tensor:
    """A normalised image back in [0, 1], per channel by its own range (the data's mean and std aren't known here)."""
    low = image.amin(dim=(1, 2), keepdim=True)
    high = image.amax(dim=(1, 2), keepdim=True)
    return ((image - low) / (high - low).clamp(min=1e-6)).cpu()


class SegmentationTask(Task):
    """Per-pixel cross-entropy (plus aux_weight x the auxiliary head's), confusion-matrix sums, and
    pixel accuracy, per-class IoU and mIoU. No batch transforms: MixUp, CutMix and label smoothing are
    refused, since a mixed or smoothed mask has no class id per pixel for the confusion matrix."""

    def __init__(self, num_classes: int, class_names: list[str] | None = None, *, aux_weight: float = 0.5,
                 ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 num_images_logged: int = 4):
        for key, value in (("trainer.label_smoothing", label_smoothing), ("data.mixup_alpha", mixup_alpha),
                           ("data.cutmix_alpha", cutmix_alpha)):
            if value != 0:
                raise ConfigError(f"{key}={value}: task=segmentation trains on hard per-pixel labels; set {key}=0")
        if ignore_index != IGNORE_INDEX:
            raise ConfigError(f"task.ignore_index={ignore_index}: the data marks pixels that count for nothing (borders, "
                              f"crop and batch padding) with {IGNORE_INDEX}; keep task.ignore_index={IGNORE_INDEX}")
        if aux_weight < 0:
            raise ConfigError(f"task.aux_weight={aux_weight}: must be >= 0 (0: the auxiliary head is not trained)")
        if num_images_logged < 0:
            raise ConfigError(f"task.num_images_logged={num_images_logged}: must be >= 0 (0: no images)")
        if class_names is not None and len(class_names) != num_classes:
            raise ConfigError(f"data: {len(class_names)} class names for {num_classes} classes")
        self.num_classes, self.class_names = num_classes, class_names
        self.aux_weight, self.ignore_index = aux_weight, ignore_index
        self.num_images_logged = num_images_logged

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        return segmentation_loss(output, targets, self.ignore_index, self.aux_weight)

    def eval_sums(self, output, targets: torch.Tensor) -> torch.Tensor:
        return confusion_sums(output, targets, self.num_classes, self.ignore_index)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        return segmentation_metrics(sums, self.class_names)

    @torch.no_grad()
    def log_validation(self, writer, model, dataset, device: torch.device, step: int) -> None:
        """`val/images`: one row per sample of the first num_images_logged val samples (the same ones at
        every validation): the input, its target and the model's prediction. Each sample goes through
        the model alone, as at batch 1; images of different sizes are padded at their right and bottom
        with black. Only where the writer writes (rank 0), except that every rank runs the forwards of a
        sharded model (strategy=fsdp), each of which is a collective."""
        count = min(self.num_images_logged, len(dataset))
        if count == 0 or not (writer.active or is_sharded(model)):
            return
        rows = []
        with torch.random.fork_rng(devices=[]):  # loading a sample must not move the training run's RNG
            samples = [images_and_labels(dataset[index]) for index in range(count)]
        for image, mask in samples:
            output = model(image.unsqueeze(0).to(device))
            prediction = (output["out"] if isinstance(output, dict) else output).argmax(dim=1)[0]
            rows += [_rescaled(image), colourise(mask, self.ignore_index), colourise(prediction, self.ignore_index)]
        if not writer.active:
            return
        height, width = max(row.shape[1] for row in rows), max(row.shape[2] for row in rows)
        rows = [F.pad(row, (0, width - row.shape[2], 0, height - row.shape[1])) for row in rows]  # black
        writer.add_image("val/images", make_grid(rows, nrow=3, padding=2, pad_value=0.5), step)
