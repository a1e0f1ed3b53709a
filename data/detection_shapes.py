"""A generated detection dataset: rectangles, discs and triangles, each in its category's colour, on
noisy dark backgrounds, with their boxes. Nothing is downloaded, and a tiny detector learns it on CPU.

Each image is drawn from its own generator, seeded by (data_seed, split, index): the same on every
rank and run, independent of the global RNG, cheap enough to draw in __getitem__. Its first draws are
its size, then its layout (background colour, shapes and boxes), then its pixels' noise: so sizes
(aspect_ratios, for aspect-ratio grouping) and the COCO ground truth come from the layout draws alone,
without drawing a pixel.

What a detection dataset meets, in small: images of different sizes and aspect ratios (the shorter
side image_size, the longer 1-2x, landscape or portrait), boxes of different sizes, images with no
shapes (empty_fraction), and crowd regions (crowd_fraction: a cluster of small shapes of one category,
one box marked iscrowd=1, in the ground truth only, where the COCO metric ignores detections in it).
Shapes don't overlap, so every box holds its whole shape."""

import colorsys
import math
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from data import DataSplits
from data.detection_transforms import (check_sizes, detection_collate, detection_sample, eval_transforms,
                                       train_transforms)
from data.shapes import KINDS, class_names
from ddp.config.schema import ConfigError

SPLIT_SEEDS = {"train": 0, "val": 1}
FILL = (50, 50, 50)  # about the mean generated pixel, in 0-255: what lsj's and ssd's padding adds
NOISE_STD = 0.1
PLACEMENT_TRIES = 10  # positions tried for a shape before it is left out (it would overlap another)
CROWD_GRID = (3, 2)  # the small shapes of a crowd region, across and down


class Shape(NamedTuple):
    category: int  # 1 .. num_categories: its kind is KINDS[(category - 1) % 3], its colour its own
    box: tuple[float, float, float, float]  # XYXY in pixels
    crowd: bool  # a cluster of small shapes, one region: iscrowd=1 in the ground truth, not in a target


class Layout(NamedTuple):
    width: int
    height: int
    background: list[float]  # RGB in [0, 0.3]
    shapes: list[Shape]


def inside(kind: str, box: tuple, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The pixels (centres x, y) that a shape of `kind` filling `box` covers."""
    x1, y1, x2, y2 = box
    if kind == "rectangle":
        return (x >= x1) & (x < x2) & (y >= y1) & (y < y2)
    if kind == "disc":  # an ellipse in a crowd's cell, a disc in a square box
        return ((2 * x - x1 - x2) / (x2 - x1)) ** 2 + ((2 * y - y1 - y2) / (y2 - y1)) ** 2 < 1
    depth = (y - y1) / (y2 - y1)  # an upright isosceles triangle, apex at the top's middle
    return (depth >= 0) & (depth < 1) & ((2 * x - x1 - x2).abs() < depth * (x2 - x1))


def apart(box: tuple, other: tuple) -> bool:
    """Whether two XYXY boxes are more than a pixel apart: no shape hides part of another."""
    return box[0] > other[2] + 1 or other[0] > box[2] + 1 or box[1] > other[3] + 1 or other[1] > box[3] + 1


def shape_area(kind: str, box: tuple) -> float:
    """The area a shape covers (COCO's `area`, which its metric sorts into small, medium and large)."""
    width, height = box[2] - box[0], box[3] - box[1]
    return width * height * {"rectangle": 1.0, "disc": math.pi / 4, "triangle": 0.5}[kind]


class DetectionShapes(Dataset):
    collate_fn = staticmethod(detection_collate)  # images differ in size, targets in their number of boxes

    def __init__(self, size: int, image_size: int, num_categories: int, data_seed: int, split: str, transform,
                 max_shapes: int = 3, empty_fraction: float = 0.1, crowd_fraction: float = 0.2):
        self.size, self.image_size, self.num_categories = size, image_size, num_categories
        self.max_shapes, self.empty_fraction, self.crowd_fraction = max_shapes, empty_fraction, crowd_fraction
        self.seed = (data_seed * len(SPLIT_SEEDS) + SPLIT_SEEDS[split]) * 1_000_003
        self.transform = transform
        # One bright colour per category, their hues evenly apart, so far apart that a tiny CNN tells
        # them in an epoch; row 0 is each image's own background (dark: at most 0.3).
        self.colours = torch.tensor([(0.0, 0.0, 0.0)] + [colorsys.hsv_to_rgb(category / num_categories, 0.7, 0.95)
                                                          for category in range(num_categories)])
        self.category_ids = list(range(1, num_categories + 1))  # label l is category l
        self.category_names = class_names(num_categories + 1)[1:]
        self.sample_ids = list(range(1, size + 1))  # COCO image ids start at 1
        # about 10 us an image: two draws of its own generator
        self.aspect_ratios = [width / height for width, height in map(self.image_shape, range(size))]
        self._ground_truth = None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        image, layout = self.draw(index)
        shapes = [shape for shape in layout.shapes if not shape.crowd]
        boxes = torch.tensor([shape.box for shape in shapes], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([shape.category for shape in shapes], dtype=torch.int64)
        return detection_sample(self.transform, image, boxes, labels, self.sample_ids[index])

    def generator(self, index: int) -> torch.Generator:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return torch.Generator().manual_seed(self.seed + index)

    def image_shape(self, index: int, generator: torch.Generator | None = None) -> tuple[int, int]:
        """(width, height): the shorter side image_size, the longer 1-2x it, portrait or landscape.
        The first two draws of the image's generator."""
        generator = self.generator(index) if generator is None else generator
        longer_factor, portrait = torch.rand(2, generator=generator).tolist()
        longer = round(self.image_size * (1 + longer_factor))
        return (self.image_size, longer) if portrait < 0.5 else (longer, self.image_size)

    def layout(self, index: int, generator: torch.Generator | None = None) -> Layout:
        """The image's size, background and shapes, drawn after its size and before its pixels."""
        generator = self.generator(index) if generator is None else generator
        width, height = self.image_shape(index, generator)
        shorter = min(width, height)

        def uniform(low: float, high: float) -> float:
            return low + (high - low) * torch.rand((), generator=generator).item()

        def category() -> int:
            return int(torch.randint(1, self.num_categories + 1, (), generator=generator))

        background = (0.3 * torch.rand(3, generator=generator)).tolist()
        empty, crowd = (torch.rand(2, generator=generator) < torch.tensor([self.empty_fraction, self.crowd_fraction])).tolist()
        wanted = []  # (category, width, height, crowd), placed in this order: a crowd region first, it is the largest
        if not empty:
            count = int(torch.randint(1, self.max_shapes + 1, (), generator=generator))
            if crowd:
                wanted.append((category(), uniform(0.35, 0.5) * shorter, uniform(0.25, 0.35) * shorter, True))
            for _ in range(count):
                label, side = category(), uniform(0.12, 0.45) * shorter
                stretch = uniform(0.5, 1.5) if KINDS[(label - 1) % len(KINDS)] == "rectangle" else 1.0
                wanted.append((label, side, side * stretch, False))
        shapes = []
        for label, box_width, box_height, is_crowd in wanted:
            for _ in range(PLACEMENT_TRIES):
                x1, y1 = uniform(0, width - box_width), uniform(0, height - box_height)
                box = (x1, y1, x1 + box_width, y1 + box_height)
                if all(apart(box, shape.box) for shape in shapes):
                    shapes.append(Shape(label, box, is_crowd))
                    break
        return Layout(width, height, background, shapes)

    def draw(self, index: int) -> tuple[torch.Tensor, Layout]:
        """The untransformed image, uint8 3 x H x W, and its layout."""
        generator = self.generator(index)
        layout = self.layout(index, generator)
        y, x = torch.meshgrid(torch.arange(layout.height) + 0.5, torch.arange(layout.width) + 0.5, indexing="ij")
        painted = torch.zeros(layout.height, layout.width, dtype=torch.int64)  # 0: background, else the category
        for shape in layout.shapes:
            kind = KINDS[(shape.category - 1) % len(KINDS)]
            for box in self.crowd_cells(shape.box) if shape.crowd else [shape.box]:
                painted[inside(kind, box, x, y)] = shape.category
        palette = self.colours.clone()
        palette[0] = torch.tensor(layout.background)
        image = palette[painted].permute(2, 0, 1) + NOISE_STD * torch.randn(3, layout.height, layout.width, generator=generator)
        return (image.clamp(0, 1) * 255).round().to(torch.uint8), layout

    @staticmethod
    def crowd_cells(box: tuple) -> list[tuple]:
        """The boxes of a crowd region's small shapes: a CROWD_GRID of cells, each shape a cell less a margin."""
        columns, rows = CROWD_GRID
        cell_width, cell_height = (box[2] - box[0]) / columns, (box[3] - box[1]) / rows
        margin_x, margin_y = 0.15 * cell_width, 0.15 * cell_height
        return [(box[0] + column * cell_width + margin_x, box[1] + row * cell_height + margin_y,
                 box[0] + (column + 1) * cell_width - margin_x, box[1] + (row + 1) * cell_height - margin_y)
                for row in range(rows) for column in range(columns)]

    def coco_ground_truth(self) -> dict:
        """The split's ground truth in COCO's format, crowd regions included (iscrowd=1), in the
        untransformed images' pixels: from the layouts, no pixel drawn; made once."""
        if self._ground_truth is None:
            images, annotations = [], []
            for index, image_id in enumerate(self.sample_ids):
                layout = self.layout(index)
                images.append({"id": image_id, "width": layout.width, "height": layout.height})
                for shape in layout.shapes:
                    x1, y1, x2, y2 = shape.box
                    kind = "rectangle" if shape.crowd else KINDS[(shape.category - 1) % len(KINDS)]
                    annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": shape.category,
                                        "bbox": [x1, y1, x2 - x1, y2 - y1], "area": shape_area(kind, shape.box),
                                        "iscrowd": int(shape.crowd)})
            categories = [{"id": category_id, "name": name} for category_id, name in zip(self.category_ids, self.category_names)]
            self._ground_truth = {"images": images, "annotations": annotations, "categories": categories}
        return self._ground_truth


def build_detection_shapes(num_samples: int, num_val_samples: int, image_size: int, num_categories: int = 3,
                           data_seed: int = 0, augment: str = "hflip", max_shapes: int = 3, empty_fraction: float = 0.1,
                           crowd_fraction: float = 0.2, multiscale_sizes: list[int] | None = None,
                           multiscale_max_size: int | None = None, lsj_size: int | None = None) -> DataSplits:
    """Train and val splits of (image, target) detection samples (data/detection_transforms.py).
    Training images get the `augment` preset; its sizes default to this data's scale, not COCO's:
    multiscale_sizes null is 0.75, 0.875, 1, 1.125 and 1.25 x image_size (as the references' 480-800
    around COCO's ~640), multiscale_max_size null no cap (the images are at most 2:1), lsj_size null
    image_size. Val images are as drawn."""
    if num_categories < 1:
        raise ConfigError(f"data.num_categories={num_categories}: needs at least one shape category; use 1 or more")
    if image_size < 16:
        raise ConfigError(f"data.image_size={image_size}: too small to draw shapes with boxes in; use 16 or more")
    if max_shapes < 1:
        raise ConfigError(f"data.max_shapes={max_shapes}: an image holds 1 to max_shapes shapes; use 1 or more "
                          "(data.empty_fraction sets how many images have none)")
    for key, value in (("empty_fraction", empty_fraction), ("crowd_fraction", crowd_fraction)):
        if not 0 <= value <= 1:
            raise ConfigError(f"data.{key}={value}: a fraction of the images; use a value in [0, 1]")
    if multiscale_sizes is None:
        multiscale_sizes = [round(image_size * factor) for factor in (0.75, 0.875, 1.0, 1.125, 1.25)]
    lsj_size = image_size if lsj_size is None else lsj_size
    check_sizes(multiscale_sizes, multiscale_max_size, lsj_size)
    train = train_transforms(augment, multiscale_sizes, multiscale_max_size, lsj_size, fill=FILL)
    options = dict(image_size=image_size, num_categories=num_categories, data_seed=data_seed, max_shapes=max_shapes,
                   empty_fraction=empty_fraction, crowd_fraction=crowd_fraction)
    return DataSplits(DetectionShapes(num_samples, split="train", transform=train, **options),
                      DetectionShapes(num_val_samples, split="val", transform=eval_transforms(), **options),
                      num_classes=num_categories + 1, in_channels=3, class_names=class_names(num_categories + 1))
