"""Joint image-and-mask transforms for semantic segmentation, as torchvision's references/segmentation
presets (transforms.v2): the image and its tv_tensors.Mask go through one call, so each random draw
(scale, crop offset, flip) moves both alike. Masks are always resized with nearest interpolation (v2
does so for a Mask), so their values stay class ids; crops pad images with 0 and masks with
IGNORE_INDEX, which the loss and the metrics skip. Random draws come from torch's global RNG, seeded
per sample by (seed, epoch, index) as the loader loads it (ddp/loading/sample_seeds.py)."""

import torch
from torch.nn import functional as F
from torchvision import tv_tensors
from torchvision.transforms import v2

IGNORE_INDEX = 255  # mask value of pixels that count for nothing: VOC's borders, crop and batch padding


class JointTransform:
    """(image, mask) -> (float image C x H x W, normalised; int64 mask H x W). The image is a PIL
    image or a tensor (uint8, or float in [0, 1]); the mask a PIL image or an integer H x W tensor."""

    def __init__(self, steps: list, mean, std):
        self.compose = v2.Compose([
            *steps,
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),  # images only; masks pass through
            v2.Normalize(mean, std),
            v2.ToDtype({tv_tensors.Mask: torch.int64, "others": None}),
        ])

    def __call__(self, image, mask):
        if not isinstance(mask, torch.Tensor):
            mask = v2.functional.pil_to_tensor(mask)[0]  # a palette PNG's pixel values: its class ids
        image, mask = self.compose(image, tv_tensors.Mask(mask))
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)


def train_transforms(base_size: int, crop_size: int, mean, std, min_scale: float = 0.5, max_scale: float = 2.0,
                     hflip_prob: float = 0.5) -> JointTransform:
    """The shorter side resized to a random size in [min_scale, max_scale] x base_size, a random
    crop_size x crop_size crop (padding what is smaller), and a horizontal flip."""
    return JointTransform([
        v2.RandomResize(int(min_scale * base_size), int(max_scale * base_size)),
        v2.RandomCrop(crop_size, pad_if_needed=True, fill={tv_tensors.Mask: IGNORE_INDEX, "others": 0}),
        v2.RandomHorizontalFlip(hflip_prob),
    ], mean, std)


def eval_transforms(base_size: int, mean, std) -> JointTransform:
    """The shorter side resized to base_size, as the reference evaluates: image sizes may differ,
    hence pad_collate."""
    return JointTransform([v2.Resize(base_size)], mean, std)


def pad_collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (image, mask) pairs of different sizes: each padded at its right and bottom to the batch's
    largest height and width, images with 0 and masks with IGNORE_INDEX, so padded pixels count in
    neither the loss nor the metrics. Images of one size are stacked as they are.

    The padding does change what a convolution sees near an image's right and bottom edges, so a model's
    predictions there can depend on which images share its batch. Evaluation is the same at any world
    size when all images have one size (data=shapes), or at batch 1 (as torchvision's reference)."""
    height = max(image.shape[-2] for image, _ in batch)
    width = max(image.shape[-1] for image, _ in batch)

    def pad(tensor, value):
        return F.pad(tensor, (0, width - tensor.shape[-1], 0, height - tensor.shape[-2]), value=value)

    return (torch.stack([pad(image, 0.0) for image, _ in batch]),
            torch.stack([pad(mask, IGNORE_INDEX) for _, mask in batch]))
