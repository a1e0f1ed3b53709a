"""Seeded in-memory images with a learnable class signal, for tests and benchmarks."""

import torch
from torch.utils.data import Dataset, TensorDataset

from data import DataSplits
from data.views import check_views, tensor_views


class RandomFlipAndNoise(Dataset):
    """Random augmentation drawn from torch's RNG (the worker's, or the main process's with no workers)."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + 0.1 * torch.randn_like(image), label


def build_synthetic(
    num_samples: int, num_val_samples: int, image_size: int, num_classes: int, channels: int, data_seed: int,
    augment: bool = False, views: int = 1,
) -> DataSplits:
    """augment: random flips and noise on the training split; with views >= 2, each view's own random
    crop, flip and blur instead (data/views.py)."""
    check_views(views)
    # Generated once here, not per __getitem__: cheap to read, identical on every rank.
    generator = torch.Generator().manual_seed(data_seed)
    prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=generator)

    def make(count: int) -> TensorDataset:
        labels = torch.randint(num_classes, (count,), generator=generator)
        noise = torch.randn(count, channels, image_size, image_size, generator=generator)
        return TensorDataset(prototypes[labels] + 2.0 * noise, labels)

    train = make(num_samples)
    if views > 1:
        train = tensor_views(train, image_size, augment, views)
    elif augment:
        train = RandomFlipAndNoise(train)
    return DataSplits(train, make(num_val_samples), num_classes, channels)
