"""A Pascal VOC-layout segmentation folder on local disk (nothing is downloaded):
    root/JPEGImages/<id>.jpg
    root/SegmentationClass/<id>.png     palette PNGs: pixel values are class ids, 255 = ignore (borders)
    root/ImageSets/Segmentation/{train,val}.txt     one id per line
with torchvision's references/segmentation transforms (data/segmentation_transforms.py)."""

from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset

from data import DataSplits
from data.presets import NORMALIZATION
from data.segmentation_transforms import eval_transforms, pad_collate, train_transforms
from data.vision import rgb_image
from ddp.config.schema import ConfigError

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor")


class VOCSegmentation(Dataset):
    collate_fn = staticmethod(pad_collate)  # images differ in size: padded to the batch's largest

    def __init__(self, root: Path, ids: list[str], transform, classes: list[str]):
        self.root, self.ids, self.transform, self.classes = root, ids, transform, classes

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        image_id = self.ids[index]
        image = rgb_image(self.root / "JPEGImages" / f"{image_id}.jpg")
        mask = Image.open(self.root / "SegmentationClass" / f"{image_id}.png")  # mode P: its values are the ids
        return self.transform(image, mask)


def read_split(root: Path, split: str) -> list[str]:
    """The ids of ImageSets/Segmentation/<split>.txt, each checked to have its image and mask."""
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise ConfigError(f"data.root={root}: no ImageSets/Segmentation/{split}.txt; a VOC-layout folder needs it "
                          "(one image id per line), beside JPEGImages/ and SegmentationClass/")
    ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    for image_id in ids:
        for path in (root / "JPEGImages" / f"{image_id}.jpg", root / "SegmentationClass" / f"{image_id}.png"):
            if not path.is_file():
                raise ConfigError(f"data.root={root}: {path.relative_to(root)} is missing, listed in {listing.relative_to(root)}; "
                                  "add the file or remove its id from the list")
    return ids


def build_voc(root: str, num_classes: int = 21, base_size: int = 520, crop_size: int = 480,
              class_names: list[str] | None = None) -> DataSplits:
    """The train and val lists of a VOC-layout folder. Training: random resize of the shorter side to
    0.5-2x base_size, a crop_size crop (masks padded with 255), a flip; evaluation: the shorter side
    resized to base_size (images differ in size: batch them with data.segmentation_transforms.pad_collate).
    Mask values must be class ids below num_classes, or 255."""
    folder = Path(root)
    if not folder.is_dir():
        raise ConfigError(f"data.root={root}: not a folder; point data.root at a VOC-layout folder "
                          "(JPEGImages/, SegmentationClass/, ImageSets/Segmentation/)")
    if class_names is None:
        class_names = list(VOC_CLASSES) if num_classes == len(VOC_CLASSES) else [f"class_{index}" for index in range(num_classes)]
    if len(class_names) != num_classes:
        raise ConfigError(f"data.class_names: {len(class_names)} names for data.num_classes={num_classes}")
    mean, std = NORMALIZATION["imagenet"]
    train = VOCSegmentation(folder, read_split(folder, "train"), train_transforms(base_size, crop_size, mean, std), class_names)
    val = VOCSegmentation(folder, read_split(folder, "val"), eval_transforms(base_size, mean, std), class_names)
    return DataSplits(train, val, num_classes=num_classes, in_channels=3, class_names=class_names)
