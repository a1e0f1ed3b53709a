"""A generated segmentation dataset: filled rectangles, discs and triangles on a noisy background.
Each image is drawn from its own generator, seeded by (data_seed, split, index): the same on every rank
and run, independent of the global RNG, and cheap enough to draw in __getitem__. Class c >= 1 is shape
kind (c - 1) % 3 in its own colour, so a tiny CNN learns it in seconds; 0 is the background."""

import torch
from torch.utils.data import Dataset

from data import DataSplits
from data.segmentation_transforms import eval_transforms, train_transforms
from ddp.config.schema import ConfigError

MEAN, STD = (0.3, 0.3, 0.3), (0.25, 0.25, 0.25)  # of the generated pixels, roughly
KINDS = ("rectangle", "disc", "triangle")
SPLIT_SEEDS = {"train": 0, "val": 1}


def class_names(num_classes: int) -> list[str]:
    return ["background"] + [f"{KINDS[(label - 1) % len(KINDS)]}{(label - 1) // len(KINDS) or ''}"
                             for label in range(1, num_classes)]


class Shapes(Dataset):
    def __init__(self, size: int, image_size: int, num_classes: int, data_seed: int, split: str, transform,
                 max_shapes: int = 3):
        self.size, self.image_size, self.num_classes, self.max_shapes = size, image_size, num_classes, max_shapes
        self.seed = (data_seed * len(SPLIT_SEEDS) + SPLIT_SEEDS[split]) * 1_000_003
        self.transform = transform
        # One bright colour per shape class, fixed by data_seed; backgrounds are darker, one per image.
        self.colours = 0.4 + 0.6 * torch.rand(num_classes, 3, generator=torch.Generator().manual_seed(data_seed))
        self.classes = class_names(num_classes)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        image, mask = self.draw(index)
        return self.transform(image, mask)

    def draw(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The untransformed sample: a float image 3 x S x S in [0, 1] and its int64 mask S x S."""
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed + index)
        size = self.image_size

        def uniform(low, high):
            return low + (high - low) * torch.rand((), generator=generator).item()

        y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
        mask = torch.zeros(size, size, dtype=torch.int64)
        count = int(torch.randint(1, self.max_shapes + 1, (), generator=generator))
        for label in torch.randint(1, self.num_classes, (count,), generator=generator).tolist():
            cy, cx, radius = uniform(0, size), uniform(0, size), uniform(0.12, 0.3) * size
            kind = KINDS[(label - 1) % len(KINDS)]
            if kind == "rectangle":
                inside = ((x - cx).abs() < radius) & ((y - cy).abs() < uniform(0.5, 1.0) * radius)
            elif kind == "disc":
                inside = (x - cx) ** 2 + (y - cy) ** 2 < radius ** 2
            else:  # an upright isosceles triangle, apex at the top
                depth = (y - (cy - radius)) / (2 * radius)
                inside = (depth >= 0) & (depth <= 1) & ((x - cx).abs() < depth * radius)
            mask[inside] = label  # later shapes cover earlier ones
        colours = self.colours.clone()
        colours[0] = 0.35 * torch.rand(3, generator=generator)
        image = colours[mask].permute(2, 0, 1) + 0.15 * torch.randn(3, size, size, generator=generator)
        return image.clamp(0, 1), mask


def build_shapes(num_samples: int, num_val_samples: int, image_size: int, num_classes: int, data_seed: int,
                 augment: bool = True, max_shapes: int = 3) -> DataSplits:
    """Train and val splits of (image 3 x H x W float, normalised; mask H x W int64, 0 = background).
    Training images get the joint train transforms (random 0.5-2x resize, an image_size crop padded with
    255 in masks, a flip) where augment is true; val images are image_size x image_size as drawn."""
    if num_classes < 2:
        raise ConfigError(f"data.num_classes={num_classes}: needs the background and at least one shape class (>= 2)")
    if image_size < 8:
        raise ConfigError(f"data.image_size={image_size}: too small to draw shapes in; use 8 or more")
    evaluate = eval_transforms(image_size, MEAN, STD)
    train = train_transforms(image_size, image_size, MEAN, STD) if augment else evaluate
    return DataSplits(Shapes(num_samples, image_size, num_classes, data_seed, "train", train, max_shapes),
                      Shapes(num_val_samples, image_size, num_classes, data_seed, "val", evaluate, max_shapes),
                      num_classes=num_classes, in_channels=3, class_names=class_names(num_classes))
