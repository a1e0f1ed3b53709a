"""torchvision datasets on local disk: ImageFolder and CIFAR-10, with the standard train and eval
transforms (data/presets.py)."""

import itertools
import logging
from pathlib import Path

import torch
from PIL import Image
from torchvision import datasets

from data import DataSplits
from data.presets import cifar10_transforms, imagefolder_transforms
from data.views import check_views
from ddp.config.schema import ConfigError

log = logging.getLogger(__name__)

ON_BAD_SAMPLE = ("error", "skip")


class BadSample(ConfigError):
    """An image file that can't be read, named with its index in its split (data.on_bad_sample=error)."""

    def __init__(self, message: str):
        # Raised in a DataLoader worker, it comes back as "Caught BadSample in DataLoader worker process N.
        # Original Traceback ...": keep the one line it was raised with.
        super().__init__(message.rstrip().splitlines()[-1].removeprefix(f"{type(self).__module__}.{type(self).__qualname__}: "))


def rgb_image(file) -> Image.Image:
    """The image in `file` (a path or a binary file object) as RGB: the pixels of torchvision's default
    ImageFolder loader (PIL's open, then convert("RGB")), without the copy that convert makes of an
    image already RGB (a decoded 500x375 JPEG: 560 KB, 30 us in a long-lived process, about 70 in a
    loader worker)."""
    with Image.open(file) as image:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")


class CheckedImageFolder(datasets.ImageFolder):
    """An ImageFolder split whose unreadable files (truncated, empty, not an image) either stop the run
    with one line naming the file and its index, or are replaced by the next readable sample of the
    split (wrapping around). The replacement depends only on the files, so it is the same on every rank,
    epoch and resume, and draws no random numbers: exact resume holds. `skipped` flags each replaced
    index; it lives in shared memory, so DataLoader workers' flags reach this process."""

    def __init__(self, root: str, transform, split: str, on_bad_sample: str):
        super().__init__(root, transform=transform, loader=rgb_image)
        self.split, self.on_bad_sample = split, on_bad_sample
        self.skipped = torch.zeros(len(self.samples), dtype=torch.uint8).share_memory_()

    def where(self, index: int) -> str:
        return self.samples[index][0]

    def __getitem__(self, index: int):
        for candidate in itertools.chain(range(index, len(self.samples)), range(index)):
            path, target = self.samples[candidate]
            try:
                image = self.loader(path)
            except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for a broken file
                if self.on_bad_sample == "error":
                    raise BadSample(f"{path} (index {candidate} of the {self.split} split): unreadable image "
                                    f"({type(error).__name__}: {error}); replace or remove the file, or set "
                                    "data.on_bad_sample=skip") from None
                self.skipped[candidate] = 1
                continue
            return (self.transform(image) if self.transform is not None else image), target
        raise BadSample(f"{self.root}: no readable image in the {self.split} split (data.on_bad_sample=skip)")


def build_imagefolder(root: str, image_size: int, augment: str | bool, random_erase: float, interpolation: str,
                      on_bad_sample: str = "error", views: int = 1) -> DataSplits:
    """`root/train/<class>/*` and `root/val/<class>/*`, as torchvision's ImageFolder reads them, and
    `root/test/<class>/*` if present (data.split=test with mode=eval). views >= 2: each training sample
    is `((view_1, ..., view_n), label)` (data/views.py)."""
    check_views(views)
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ConfigError(f"data.on_bad_sample={on_bad_sample}: must be one of {' | '.join(ON_BAD_SAMPLE)}")
    for split in ("train", "val"):
        if not (Path(root) / split).is_dir():
            raise ConfigError(f"data.root={root}: no {split}/ folder; ImageFolder needs {root}/{split}/<class>/<image>")
    train_transform, eval_transform, normalization = imagefolder_transforms(image_size, augment, random_erase, interpolation, views)
    transforms = {"train": train_transform, "val": eval_transform, "test": eval_transform}
    folders = {}
    for split, transform in transforms.items():
        if split == "test" and not (Path(root) / split).is_dir():
            continue
        try:
            folders[split] = CheckedImageFolder(str(Path(root) / split), transform, split, on_bad_sample)
        except FileNotFoundError as error:  # no class folders, or no images in them
            raise ConfigError(f"data.root={root}: {error}") from None
        folders[split].image_normalization = normalization  # its loaders' uint8 batches, normalized on the device
        if folders[split].classes != folders["train"].classes:
            # Each ImageFolder numbers its own classes; different folders would silently mislabel.
            raise ConfigError(f"data.root={root}: train/ and {split}/ hold different class folders "
                              f"({folders['train'].classes} vs {folders[split].classes})")
    return DataSplits(folders["train"], folders["val"], num_classes=len(folders["train"].classes), in_channels=3,
                      test=folders.get("test"))


def build_cifar10(root: str, download: bool, augment: str | bool, random_erase: float, interpolation: str,
                  views: int = 1) -> DataSplits:
    """The 50,000 training images, and the 10,000 test images as both the val and the test split.
    views >= 2: each training sample is `((view_1, ..., view_n), label)` (data/views.py)."""
    check_views(views)
    train_transform, eval_transform, normalization = cifar10_transforms(augment, random_erase, interpolation, views)
    try:
        train = datasets.CIFAR10(root, train=True, download=download, transform=train_transform)
        test = datasets.CIFAR10(root, train=False, download=download, transform=eval_transform)
    except RuntimeError as error:  # torchvision's "Dataset not found or corrupted"
        raise ConfigError(f"data.root={root}: CIFAR-10 not found ({error}); set data.download=true or copy it there") from None
    train.image_normalization = test.image_normalization = normalization
    return DataSplits(train, test, num_classes=10, in_channels=3, test=test)
