"""torchvision datasets on local disk: ImageFolder and CIFAR-10, with the standard train and eval
transforms (data/presets.py)."""

from pathlib import Path

from torchvision import datasets

from data import DataSplits
from data.presets import cifar10_transforms, imagefolder_transforms
from ddp.config import ConfigError


def build_imagefolder(root: str, image_size: int, augment: str, random_erase: float, interpolation: str) -> DataSplits:
    """`root/train/<class>/*` and `root/val/<class>/*`, as torchvision's ImageFolder reads them, and
    `root/test/<class>/*` if present (data.split=test with mode=eval)."""
    for split in ("train", "val"):
        if not (Path(root) / split).is_dir():
            raise ConfigError(f"data.root={root}: no {split}/ folder; ImageFolder needs {root}/{split}/<class>/<image>")
    train_transform, eval_transform = imagefolder_transforms(image_size, augment, random_erase, interpolation)
    transforms = {"train": train_transform, "val": eval_transform, "test": eval_transform}
    folders = {}
    for split, transform in transforms.items():
        if split == "test" and not (Path(root) / split).is_dir():
            continue
        try:
            folders[split] = datasets.ImageFolder(str(Path(root) / split), transform=transform)
        except FileNotFoundError as error:  # no class folders, or no images in them
            raise ConfigError(f"data.root={root}: {error}") from None
        if folders[split].classes != folders["train"].classes:
            # Each ImageFolder numbers its own classes; different folders would silently mislabel.
            raise ConfigError(f"data.root={root}: train/ and {split}/ hold different class folders "
                              f"({folders['train'].classes} vs {folders[split].classes})")
    return DataSplits(folders["train"], folders["val"], num_classes=len(folders["train"].classes), in_channels=3,
                      test=folders.get("test"))


def build_cifar10(root: str, download: bool, augment: str, random_erase: float, interpolation: str) -> DataSplits:
    """The 50,000 training images, and the 10,000 test images as both the val and the test split."""
    train_transform, eval_transform = cifar10_transforms(augment, random_erase, interpolation)
    try:
        train = datasets.CIFAR10(root, train=True, download=download, transform=train_transform)
        test = datasets.CIFAR10(root, train=False, download=download, transform=eval_transform)
    except RuntimeError as error:  # torchvision's "Dataset not found or corrupted"
        raise ConfigError(f"data.root={root}: CIFAR-10 not found ({error}); set data.download=true or copy it there") from None
    return DataSplits(train, test, num_classes=10, in_channels=3, test=test)
