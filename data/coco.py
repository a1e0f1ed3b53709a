"""COCO-format detection data on local disk (nothing is downloaded), in COCO 2017's layout:
    root/annotations/instances_train2017.json    root/train2017/<file_name>
    root/annotations/instances_val2017.json      root/val2017/<file_name>
or each split's annotation file and image folder given on its own (data.train_annotations,
data.train_images, data.val_annotations, data.val_images), which override root's.

Everything is checked when the run starts, each problem a one-line error naming the key to change:
a missing file or folder, a JSON file that isn't COCO's (an object with `images`, `annotations` and
`categories` lists, each entry with the fields read here), an annotation of an unknown image or
category, a box outside its image by more than BOX_TOLERANCE_PX, train and val with different
categories. The annotations are then kept as tensors, not as the JSON's dicts: a DataLoader worker
touching a Python object copies its page (a split of COCO train holds 860k annotations).

Category ids (COCO's run 1-90 with gaps) map to contiguous labels 1..K in id order, 0 being the
background of torchvision's detectors. Crowd annotations (iscrowd=1) are regions the metric ignores:
they are in coco_ground_truth(), never in a target, as torchvision's references load COCO. Images
listed without annotations are samples, with no boxes."""

import json
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from data import DataSplits
from data.detection_transforms import (MULTISCALE_SIZES, check_sizes, detection_collate, detection_sample,
                                       eval_transforms, train_transforms)
from data.vision import rgb_image
from ddp.config.schema import ConfigError

# How far a box may reach past its image's edge, in pixels, and be clipped to it: COCO's boxes, traced
# from polygons, may overshoot by a fraction of a pixel. Beyond it the box is likely another image's,
# or x, y, w, h read as x1, y1, x2, y2: an error.
BOX_TOLERANCE_PX = 1.0
FIELDS = {"images": ("id", "file_name", "width", "height"), "categories": ("id", "name"),
          "annotations": ("id", "image_id", "category_id", "bbox")}


class Source:
    """A path and the config key that gave it, for error lines: `data.val_annotations=<path>`, or
    `data.root=<root>` for a path within the root."""

    def __init__(self, path: Path, key: str, value: str):
        self.path, self.key, self.value = path, key, value

    def error(self, problem: str) -> ConfigError:
        within = "" if self.key != "data.root" else f"{self.path.relative_to(self.value)}: "
        return ConfigError(f"{self.key}={self.value}: {within}{problem}")


def split_sources(split: str, root: str | None, annotations: str | None, images: str | None) -> tuple[Source, Source]:
    """The split's annotation file and image folder: the explicit key if set, else root's COCO 2017 path."""
    sources = []
    for name, explicit, within_root in (("annotations", annotations, f"annotations/instances_{split}2017.json"),
                                        ("images", images, f"{split}2017")):
        if explicit is not None:
            sources.append(Source(Path(explicit), f"data.{split}_{name}", explicit))
        elif root is not None:
            sources.append(Source(Path(root) / within_root, "data.root", root))
        else:
            raise ConfigError(f"data.{split}_{name}: not set, and no data.root; set data.root to a folder in COCO 2017's "
                              f"layout (annotations/, train2017/, val2017/) or data.{split}_{name} to its path")
    return sources[0], sources[1]


def read_annotations(source: Source) -> dict:
    """The annotation file's JSON, checked to be COCO's: every entry has the fields read here, every
    annotation's image and category exist, every box lies in its image (BOX_TOLERANCE_PX)."""
    if not source.path.is_file():
        raise source.error("no such file; point it at a COCO annotation file (e.g. annotations/instances_val2017.json)")
    try:
        coco = json.loads(source.path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise source.error(f"not JSON ({error}); point it at a COCO annotation file") from None
    if not isinstance(coco, dict) or not all(isinstance(coco.get(name), list) for name in FIELDS):
        raise source.error("not a COCO annotation file: needs a JSON object with 'images', 'annotations' and "
                           "'categories' lists; point it at one (e.g. annotations/instances_val2017.json)")
    for name, fields in FIELDS.items():
        for position, entry in enumerate(coco[name]):
            missing = [field for field in fields if not isinstance(entry, dict) or field not in entry]
            if missing:
                raise source.error(f"{name}[{position}] has no {', '.join(missing)}, which every entry of '{name}' needs "
                                   f"({', '.join(fields)}); fix or remove it")
    images = {image["id"]: image for image in coco["images"]}
    categories = {category["id"] for category in coco["categories"]}
    for annotation in coco["annotations"]:
        if annotation["image_id"] not in images:
            raise source.error(f"annotation {annotation['id']} is of image_id {annotation['image_id']}, which 'images' "
                               "doesn't list; add the image or remove the annotation")
        if annotation["category_id"] not in categories:
            raise source.error(f"annotation {annotation['id']} is of category_id {annotation['category_id']}, which "
                               "'categories' doesn't list; add the category or remove the annotation")
        image = images[annotation["image_id"]]
        bbox = annotation["bbox"]
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(value, (int, float)) for value in bbox)):
            raise source.error(f"annotation {annotation['id']}'s bbox {bbox} isn't 4 numbers [x, y, width, height]; fix it")
        x, y, width, height = bbox
        if (width < 0 or height < 0 or x < -BOX_TOLERANCE_PX or y < -BOX_TOLERANCE_PX
                or x + width > image["width"] + BOX_TOLERANCE_PX or y + height > image["height"] + BOX_TOLERANCE_PX):
            raise source.error(f"annotation {annotation['id']}'s bbox [x, y, w, h] {bbox} lies outside its image "
                               f"{image['file_name']} ({image['width']}x{image['height']}) by more than "
                               f"{BOX_TOLERANCE_PX:g} px; fix or remove the annotation")
    return coco


def check_images(coco: dict, source: Source) -> None:
    """Every image the file lists is in the folder: one listing of the folder, not a stat per image
    (but for a file_name in a subfolder)."""
    if not source.path.is_dir():
        raise source.error("no such folder; point it at the split's image folder (e.g. val2017/)")
    present = set(os.listdir(source.path))
    missing = [image["file_name"] for image in coco["images"]
               if image["file_name"] not in present and not (source.path / image["file_name"]).is_file()]
    if missing:
        raise source.error(f"{len(missing)} image(s) listed in the annotation file are missing, e.g. {missing[0]}; "
                           "add them or point the key at the folder that holds them")


def annotation_tensors(annotations: list[dict], label: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COCO annotations as tensors: their boxes as COCO's [x, y, w, h] (float64 N x 4), their labels
    (int64, `label` maps a category id to its label) and their crowd flags (iscrowd, bool)."""
    bboxes = torch.tensor([a["bbox"] for a in annotations], dtype=torch.float64).reshape(-1, 4)
    labels = torch.tensor([label[a["category_id"]] for a in annotations], dtype=torch.int64)
    crowd = torch.tensor([bool(a.get("iscrowd", 0)) for a in annotations], dtype=torch.bool)
    return bboxes, labels, crowd


def target_boxes(bboxes: torch.Tensor, labels: torch.Tensor, crowd: torch.Tensor, width: int,
                 height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's annotations (annotation_tensors) as its target's XYXY boxes and labels: crowd regions
    left out (the metric ignores them; a detector must not learn them as objects), boxes clipped to the
    image (read_annotations let them overshoot by BOX_TOLERANCE_PX). data=webdataset's detection shards
    make their targets here too, so they train as the folder does."""
    keep = ~crowd
    boxes = bboxes[keep].clone()
    boxes[:, 2:] += boxes[:, :2]  # x, y, w, h -> x1, y1, x2, y2
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
    return boxes, labels[keep]


class CocoDetection(Dataset):
    """A split's images and annotations, as tensors: image index i's annotations are rows
    starts[i]:starts[i + 1] (sorted by image), boxes as COCO's [x, y, w, h]."""

    collate_fn = staticmethod(detection_collate)  # images differ in size, targets in their number of boxes

    def __init__(self, coco: dict, images: Source, transform):
        self.images, self.transform = images, transform
        records = sorted(coco["images"], key=lambda image: image["id"])
        self.sample_ids = [image["id"] for image in records]
        self.file_names = [image["file_name"] for image in records]
        self.sizes = torch.tensor([[image["width"], image["height"]] for image in records], dtype=torch.int64).reshape(-1, 2)
        self.aspect_ratios = [image["width"] / image["height"] for image in records]
        categories = sorted(coco["categories"], key=lambda category: category["id"])
        self.category_ids = [category["id"] for category in categories]
        self.category_names = [category["name"] for category in categories]
        position = {image_id: index for index, image_id in enumerate(self.sample_ids)}
        label = {category_id: index + 1 for index, category_id in enumerate(self.category_ids)}
        annotations = sorted(coco["annotations"], key=lambda annotation: (position[annotation["image_id"]], annotation["id"]))
        self.image_index = torch.tensor([position[a["image_id"]] for a in annotations], dtype=torch.int64)
        self.starts = torch.searchsorted(self.image_index, torch.arange(len(records) + 1))
        self.annotation_ids = torch.tensor([a["id"] for a in annotations], dtype=torch.int64)
        self.bboxes, self.labels, self.crowd = annotation_tensors(annotations, label)
        self.areas = torch.tensor([a.get("area", a["bbox"][2] * a["bbox"][3]) for a in annotations], dtype=torch.float64)
        self._ground_truth = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int):
        path = self.images.path / self.file_names[index]
        image = rgb_image(path)
        width, height = self.sizes[index].tolist()
        if image.size != (width, height):  # the boxes would be in another image's pixels
            raise self.images.error(f"{self.file_names[index]} is {image.width}x{image.height}, its annotation file says "
                                    f"{width}x{height}; fix the file's width and height or the image")
        rows = slice(self.starts[index], self.starts[index + 1])
        boxes, labels = target_boxes(self.bboxes[rows], self.labels[rows], self.crowd[rows], width, height)
        return detection_sample(self.transform, image, boxes, labels, self.sample_ids[index])

    def coco_ground_truth(self) -> dict:
        """The split's ground truth in COCO's format, crowd regions included (iscrowd=1), boxes as the
        file gives them: what pycocotools' COCO is built from to evaluate. Made once."""
        if self._ground_truth is None:
            images = [{"id": image_id, "width": width, "height": height, "file_name": file_name}
                      for image_id, file_name, (width, height) in zip(self.sample_ids, self.file_names, self.sizes.tolist())]
            annotations = [{"id": annotation_id, "image_id": self.sample_ids[index], "category_id": self.category_ids[label - 1],
                            "bbox": bbox, "area": area, "iscrowd": int(crowd)}
                           for annotation_id, index, label, bbox, area, crowd in zip(
                               self.annotation_ids.tolist(), self.image_index.tolist(), self.labels.tolist(),
                               self.bboxes.tolist(), self.areas.tolist(), self.crowd.tolist())]
            categories = [{"id": category_id, "name": name} for category_id, name in zip(self.category_ids, self.category_names)]
            self._ground_truth = {"images": images, "annotations": annotations, "categories": categories}
        return self._ground_truth


def build_coco(root: str | None = None, train_annotations: str | None = None, train_images: str | None = None,
               val_annotations: str | None = None, val_images: str | None = None, augment: str = "hflip",
               multiscale_sizes: list[int] | None = None, multiscale_max_size: int = 1333, lsj_size: int = 1024) -> DataSplits:
    """The train and val splits of a COCO-format folder (module docstring). Training images get the
    `augment` preset (data/detection_transforms.py; multiscale_sizes null: the references' 480, 512,
    ..., 800); val images are as decoded. num_classes is the number of categories + 1 (the background)."""
    multiscale_sizes = MULTISCALE_SIZES if multiscale_sizes is None else multiscale_sizes
    check_sizes(multiscale_sizes, multiscale_max_size, lsj_size)
    transform = {"train": train_transforms(augment, multiscale_sizes, multiscale_max_size, lsj_size), "val": eval_transforms()}
    sources = {"train": split_sources("train", root, train_annotations, train_images),
               "val": split_sources("val", root, val_annotations, val_images)}
    datasets, categories = {}, {}
    for split in ("val", "train"):  # val's file is the smaller: its mistakes show in seconds, not after train's
        annotations, images = sources[split]
        coco = read_annotations(annotations)
        check_images(coco, images)
        categories[split] = sorted((category["id"], category["name"]) for category in coco["categories"])
        datasets[split] = CocoDetection(coco, images, transform[split])
    if not categories["train"]:
        raise sources["train"][0].error("its 'categories' list is empty; a detector needs one category or more")
    if categories["train"] != categories["val"]:
        differ = sorted(set(categories["train"]) ^ set(categories["val"]))[:3]
        raise sources["val"][0].error(f"its categories differ from the train split's ((id, name) {differ} in one only); "
                                      "train and val need the same 'categories' list")
    return DataSplits(datasets["train"], datasets["val"], num_classes=len(categories["train"]) + 1, in_channels=3,
                      class_names=["background", *datasets["train"].category_names])
