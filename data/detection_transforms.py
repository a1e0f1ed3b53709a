"""Transforms and batching for object detection, as torchvision's references/detection presets
(transforms.v2). A sample's image and its tv_tensors.BoundingBoxes go through one call, so each random
draw (a flip, a scale, a crop) moves the boxes with the pixels; SanitizeBoundingBoxes then drops the
boxes a crop or a zoom left degenerate (under 1 px), with their labels.

A sample leaves as (image, target): the image float32 3 x H x W in [0, 1], not normalised (the
detectors normalise and resize inside, torchvision's GeneralizedRCNNTransform), the target
{"boxes": float32 N x 4 XYXY in the transformed image's pixels, "labels": int64 N, "image_id": int},
all plain tensors. Evaluation neither resizes nor crops, as the references evaluate: predictions come
back in the untransformed image's coordinates, those of the ground truth.

Random draws come from torch's global RNG, seeded per sample by (seed, epoch, index) as the loader
loads it (ddp/loading/sample_seeds.py), and from nothing else."""

from collections.abc import Sequence

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from ddp.config.schema import ConfigError
from ddp.loading.batches import SampleList

AUGMENTS = ("none", "hflip", "multiscale", "lsj", "ssd", "ssdlite")
MULTISCALE_SIZES = tuple(range(480, 801, 32))  # the references' shortest-side choices for COCO
IMAGENET_MEAN_UINT8 = (123, 117, 104)  # the references' fill for what a zoom-out or a crop adds


def target_labels(inputs: tuple) -> torch.Tensor:
    """SanitizeBoundingBoxes' labels_getter: the labels of an (image, target) sample, dropped with their boxes."""
    return inputs[1]["labels"]


def finish(steps: list) -> v2.Compose:
    """`steps` on a uint8 image (ToImage first: a PIL image or a uint8 tensor), then the sample's
    final form. The steps run on uint8, as the references' do on PIL images: resizes cost less, and
    a fill given in 0-255 means what it says."""
    return v2.Compose([
        v2.ToImage(),
        *steps,
        v2.ToDtype(torch.float32, scale=True),  # images only: boxes stay float32, labels int64
        v2.SanitizeBoundingBoxes(labels_getter=target_labels),
        v2.ToPureTensor(),
    ])


def train_transforms(augment: str, multiscale_sizes: Sequence[int] = MULTISCALE_SIZES, multiscale_max_size: int | None = 1333,
                     lsj_size: int = 1024, fill: Sequence[int] = IMAGENET_MEAN_UINT8, hflip_prob: float = 0.5) -> v2.Compose:
    """The references' training preset `augment` (data.augment):
    - none: the image as it is;
    - hflip: RandomHorizontalFlip;
    - multiscale: the shorter side resized to one of `multiscale_sizes` (the references' 480, 512, ..., 800),
      the longer capped at `multiscale_max_size` (1333; None: no cap), then a flip;
    - lsj (large-scale jitter): ScaleJitter to a `lsj_size` square (1024) at 0.1-2x, a random `lsj_size`
      square crop padded with `fill` where the image is smaller, then a flip. transforms.v2 has no
      FixedSizeCrop (the references' own transform): RandomCrop with pad_if_needed gives the same fixed
      size, its padding on any side, not only the right and bottom;
    - ssd: RandomPhotometricDistort, RandomZoomOut filled with `fill`, RandomIoUCrop, a flip;
    - ssdlite: RandomIoUCrop and a flip.
    `fill` is in 0-255 (the steps see uint8 images): the references' ImageNet mean, or a dataset's own."""
    fill = {tv_tensors.Image: list(fill), "others": 0}
    flip = v2.RandomHorizontalFlip(hflip_prob)
    if augment == "none":
        steps = []
    elif augment == "hflip":
        steps = [flip]
    elif augment == "multiscale":
        steps = [v2.RandomShortestSize(min_size=list(multiscale_sizes), max_size=multiscale_max_size, antialias=True), flip]
    elif augment == "lsj":
        steps = [v2.ScaleJitter(target_size=(lsj_size, lsj_size), antialias=True),
                 v2.RandomCrop(lsj_size, pad_if_needed=True, fill=fill), flip]
    elif augment == "ssd":
        steps = [v2.RandomPhotometricDistort(), v2.RandomZoomOut(fill=fill), v2.RandomIoUCrop(), flip]
    elif augment == "ssdlite":
        steps = [v2.RandomIoUCrop(), flip]
    else:
        raise ConfigError(f"data.augment={augment}: not a detection preset; use one of {' | '.join(AUGMENTS)}")
    return finish(steps)


def eval_transforms() -> v2.Compose:
    """The image as it is: the detector's own transform resizes it and maps its predictions back, so
    they are in the ground truth's coordinates."""
    return finish([])


def check_sizes(multiscale_sizes: Sequence[int], multiscale_max_size: int | None, lsj_size: int) -> None:
    """The presets' sizes, each a positive number of pixels (a one-line error naming its key);
    multiscale_max_size None: no cap."""
    if not multiscale_sizes or min(multiscale_sizes) < 1:
        raise ConfigError(f"data.multiscale_sizes={list(multiscale_sizes)}: needs one or more shorter-side sizes in pixels, "
                          "each 1 or more; use e.g. [480, 512, 544]")
    for key, value in (("multiscale_max_size", multiscale_max_size), ("lsj_size", lsj_size)):
        if value is not None and value < 1:
            raise ConfigError(f"data.{key}={value}: a size in pixels; use 1 or more")


def detection_sample(transform, image, boxes: torch.Tensor, labels: torch.Tensor, image_id: int) -> tuple:
    """(image, target) through `transform`: `image` a PIL image or a uint8 3 x H x W tensor, `boxes`
    N x 4 XYXY in its pixels, `labels` int64 N (1 .. number of categories). The target's `seed`, drawn
    after the transform from the RNG the loader seeds per sample, is what Faster R-CNN's RPN and ROI
    samplers draw this image's boxes from (models/detection.py: PerImageSampler): a function of
    (run seed, epoch, index), so the same at any world size and batch."""
    canvas_size = tuple(v2.functional.get_size(image))  # (height, width), of a PIL image or a tensor
    target = {"boxes": tv_tensors.BoundingBoxes(boxes.to(torch.float32).reshape(-1, 4), format="XYXY", canvas_size=canvas_size),
              "labels": labels.to(torch.int64), "image_id": int(image_id)}
    image, target = transform(image, target)
    target["seed"] = int(torch.randint(2**62, ()))
    return image, target


def detection_collate(samples: list[tuple]) -> tuple[SampleList, SampleList]:
    """A batch of (image, target) samples as (images, targets), each a SampleList: images differ in
    size and targets in their number of boxes, so neither is stacked; a torchvision detector takes
    both lists as they are."""
    images, targets = zip(*samples)
    return SampleList(images), SampleList(targets)
