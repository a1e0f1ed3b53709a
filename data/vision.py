"""torchvision datasets on local disk: ImageFolder and CIFAR-10."""

from pathlib import Path

from torchvision import datasets, transforms

from data import DataSplits
from ddp.config import ConfigError

_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build_imagefolder(root: str, image_size: int) -> DataSplits:
    """`root/train/<class>/*` and `root/val/<class>/*`, as torchvision's ImageFolder reads them."""
    for split in ("train", "val"):
        if not (Path(root) / split).is_dir():
            raise ConfigError(f"data.root={root}: no {split}/ folder; ImageFolder needs {root}/{split}/<class>/<image>")
    transform = transforms.Compose(
        [
            transforms.Resize(image_size),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            transforms.Normalize(_IMAGENET_MEAN, _IMAGENET_STD),
        ]
    )
    try:
        train = datasets.ImageFolder(str(Path(root) / "train"), transform=transform)
        val = datasets.ImageFolder(str(Path(root) / "val"), transform=transform)
    except FileNotFoundError as error:  # no class folders, or no images in them
        raise ConfigError(f"data.root={root}: {error}") from None
    if train.classes != val.classes:
        # Each ImageFolder numbers its own classes; different folders would silently mislabel.
        raise ConfigError(f"data.root={root}: train/ and val/ hold different class folders ({train.classes} vs {val.classes})")
    return DataSplits(train, val, num_classes=len(train.classes), in_channels=3)


def build_cifar10(root: str, download: bool) -> DataSplits:
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))]
    )
    try:
        train = datasets.CIFAR10(root, train=True, download=download, transform=transform)
        val = datasets.CIFAR10(root, train=False, download=download, transform=transform)
    except RuntimeError as error:  # torchvision's "Dataset not found or corrupted"
        raise ConfigError(f"data.root={root}: CIFAR-10 not found ({error}); set data.download=true or copy it there") from None
    return DataSplits(train, val, num_classes=10, in_channels=3)
