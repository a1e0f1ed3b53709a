"""The standard train and eval transforms, as in torchvision's references/classification presets
(transforms.v2). Training augments (random crop and flip, an optional policy, random erasing);
evaluation is deterministic. With data.views >= 2 the train transform gives a tuple of views, each
its own draw of SimCLR's augmentation (data/views.py). Random draws come from torch's global RNG,
seeded per sample by (seed, epoch, index) as the loader loads it (ddp/loading/sample_seeds.py).

Both end in the dataset's ImageNormalization (ddp/loading/batches.py), which the repo's loader workers
leave to the device: their images travel as uint8. With random erasing, which erases normalized pixels,
the train transform normalizes in the worker, as transforms.v2 does."""

from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from data.views import BLUR_SIGMA, Views, blur_kernel_size
from ddp.config.schema import ConfigError
from ddp.loading.batches import ImageNormalization
from ddp.loading.collate import image_place

# Per-channel mean and std of each dataset's training images, the one place they are stated.
NORMALIZATION = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
AUGMENTS = ("none", "standard", "randaugment", "trivialaugment", "autoaugment")
VIEW_AUGMENTS = ("none", "standard")  # with data.views >= 2, standard is SimCLR's augmentation of each view
INTERPOLATIONS = {
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
    "nearest": v2.InterpolationMode.NEAREST,
}
EVAL_CROP_FRACTION = 0.875  # ImageNet convention: resize to crop / 0.875 (256 for 224), then centre-crop


class Transforms(NamedTuple):
    train: object
    eval: object
    normalization: ImageNormalization  # the datasets' image_normalization: the last step of both


def imagefolder_transforms(image_size: int, augment: str | bool, random_erase: float, interpolation: str,
                           views: int = 1) -> Transforms:
    """(train, eval, normalization): RandomResizedCrop + flip for training; Resize(image_size / 0.875) + CenterCrop to eval.
    augment=none trains on the eval transform. views >= 2: a tuple of views, each SimCLR's augmentation."""
    mode = _interpolation(interpolation)
    augment = _augment(augment, views)
    eval_geometry = [v2.Resize(int(image_size / EVAL_CROP_FRACTION), interpolation=mode, antialias=True),
                     v2.CenterCrop(image_size)]
    train_geometry = [v2.RandomResizedCrop(image_size, interpolation=mode, antialias=True), v2.RandomHorizontalFlip()]
    if views > 1:
        train_geometry = _simclr_steps(train_geometry[0], image_size, colour_strength=1.0)
    normalization = ImageNormalization(*NORMALIZATION["imagenet"])
    train = _train(train_geometry, eval_geometry, augment, random_erase, mode, v2.AutoAugmentPolicy.IMAGENET, normalization)
    return Transforms(_views(train, views), _compose(eval_geometry, normalization), normalization)


def cifar10_transforms(augment: str | bool, random_erase: float, interpolation: str, views: int = 1) -> Transforms:
    """(train, eval, normalization): 4-pixel padded RandomCrop + flip for training; the 32 px images as they are to eval.
    views >= 2: a tuple of views, each SimCLR's augmentation (its CIFAR-10 colour strength, 0.5)."""
    train_geometry = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
    mode = _interpolation(interpolation)
    augment = _augment(augment, views)
    if views > 1:
        train_geometry = _simclr_steps(v2.RandomResizedCrop(32, interpolation=mode, antialias=True), 32,
                                       colour_strength=0.5)
    normalization = ImageNormalization(*NORMALIZATION["cifar10"])
    train = _train(train_geometry, [], augment, random_erase, mode, v2.AutoAugmentPolicy.CIFAR10, normalization)
    return Transforms(_views(train, views), _compose([], normalization), normalization)


def _augment(augment: str | bool, views: int) -> str:
    """data.augment as one of AUGMENTS: data.augment=true | false (a bool from the command line, as the
    tensor datasets take it) means standard | none. The policies are single-image augmentation: views
    get SimCLR's."""
    if isinstance(augment, bool):
        augment = "standard" if augment else "none"
    if views > 1 and augment in AUGMENTS and augment not in VIEW_AUGMENTS:
        raise ConfigError(f"data.augment={augment}: with data.views={views} each view gets SimCLR's augmentation; "
                          "use data.augment=standard (SimCLR's) or none (each view is the eval image)")
    return augment


def _simclr_steps(crop, image_size: int, colour_strength: float) -> list:
    """SimCLR's augmentation (Chen et al. 2020, appendix A) on a PIL image: crop, flip, colour jitter of
    strength s (1 for ImageNet, 0.5 for CIFAR-10) with p 0.8, grayscale with p 0.2, blur with p 0.5."""
    s = colour_strength
    return [crop, v2.RandomHorizontalFlip(),
            v2.RandomApply([v2.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(blur_kernel_size(image_size), BLUR_SIGMA)], p=0.5)]


def _views(train: v2.Compose, views: int):
    """The train transform itself for one view (a sample exactly as without views), else `views` draws of it."""
    return train if views == 1 else Views(train, views)


def _train(geometry: list, eval_geometry: list, augment: str, random_erase: float, mode, policy,
           normalization: ImageNormalization) -> v2.Compose:
    if augment not in AUGMENTS:
        raise ConfigError(f"data.augment={augment}: unknown, use one of {', '.join(AUGMENTS)}")
    if not 0 <= random_erase <= 1:
        raise ConfigError(f"data.random_erase={random_erase}: must be a probability in [0, 1]")
    if augment == "none":
        steps = eval_geometry
    else:
        policies = {
            "randaugment": lambda: [v2.RandAugment(interpolation=mode)],
            "trivialaugment": lambda: [v2.TrivialAugmentWide(interpolation=mode)],
            "autoaugment": lambda: [v2.AutoAugment(policy, interpolation=mode)],
        }
        steps = [*geometry, *policies.get(augment, list)()]
    if random_erase > 0:  # it erases normalized pixels (to 0, the mean): normalized in the worker, then erased
        normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(normalization.mean, normalization.std)]
        return v2.Compose([*steps, v2.PILToTensor(), *normalize, v2.RandomErasing(p=random_erase)])
    return _compose(steps, normalization)


def _compose(steps: list, normalization: ImageNormalization) -> v2.Compose:
    return v2.Compose([*steps, UInt8Image(), normalization])


class UInt8Image:
    """PILToTensor: a PIL image to uint8 (C, H, W), its values and layout, anything else as it is. In a loader
    worker loading a batch, an RGB image is written straight into its place in the batch's shared memory,
    which is then the batch, collated without a copy (ddp/loading/collate.py)."""

    def __call__(self, image):
        if not isinstance(image, Image.Image):
            return image
        place = image_place(image.height, image.width) if image.mode == "RGB" else None
        if place is None:
            return v2.functional.pil_to_tensor(image)
        place.numpy()[...] = np.asarray(image)
        return place.permute(2, 0, 1)

    def __repr__(self) -> str:
        return "UInt8Image()"


def _interpolation(name: str):
    if name not in INTERPOLATIONS:
        raise ConfigError(f"data.interpolation={name}: unknown, use one of {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]
