"""The standard train and eval transforms, as in torchvision's references/classification presets
(transforms.v2). Training augments (random crop and flip, an optional policy, random erasing);
evaluation is deterministic. Random draws come from torch's RNG: in a DataLoader worker, the one
seeded per (rank, epoch) by ddp.loading.loaders.start_epoch."""

import torch
from torchvision.transforms import v2

from ddp.config.schema import ConfigError

# Per-channel mean and std of each dataset's training images, the one place they are stated.
NORMALIZATION = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
AUGMENTS = ("none", "standard", "randaugment", "trivialaugment", "autoaugment")
INTERPOLATIONS = {
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
    "nearest": v2.InterpolationMode.NEAREST,
}
EVAL_CROP_FRACTION = 0.875  # ImageNet convention: resize to crop / 0.875 (256 for 224), then centre-crop


def imagefolder_transforms(image_size: int, augment: str, random_erase: float, interpolation: str):
    """(train, eval): RandomResizedCrop + flip for training; Resize(image_size / 0.875) + CenterCrop to eval.
    augment=none trains on the eval transform."""
    mode = _interpolation(interpolation)
    eval_geometry = [v2.Resize(int(image_size / EVAL_CROP_FRACTION), interpolation=mode, antialias=True),
                     v2.CenterCrop(image_size)]
    train_geometry = [v2.RandomResizedCrop(image_size, interpolation=mode, antialias=True), v2.RandomHorizontalFlip()]
    return (_train(train_geometry, eval_geometry, augment, random_erase, mode, v2.AutoAugmentPolicy.IMAGENET, "imagenet"),
            _compose(eval_geometry, "imagenet"))


def cifar10_transforms(augment: str, random_erase: float, interpolation: str):
    """(train, eval): 4-pixel padded RandomCrop + flip for training; the 32 px images as they are to eval."""
    train_geometry = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
    mode = _interpolation(interpolation)
    return (_train(train_geometry, [], augment, random_erase, mode, v2.AutoAugmentPolicy.CIFAR10, "cifar10"),
            _compose([], "cifar10"))


def _train(geometry: list, eval_geometry: list, augment: str, random_erase: float, mode, policy, dataset: str) -> v2.Compose:
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
    erase = [v2.RandomErasing(p=random_erase)] if random_erase > 0 else []
    return _compose(steps, dataset, after=erase)


def _compose(steps: list, dataset: str, after: list = ()) -> v2.Compose:
    mean, std = NORMALIZATION[dataset]
    return v2.Compose([*steps, v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std), *after])


def _interpolation(name: str):
    if name not in INTERPOLATIONS:
        raise ConfigError(f"data.interpolation={name}: unknown, use one of {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]
