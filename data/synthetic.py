"""Seeded in-memory images with a learnable class signal, for tests and benchmarks."""

import torch
from torch.utils.data import TensorDataset

from data import DataSplits


def build_synthetic(
    num_samples: int, num_val_samples: int, image_size: int, num_classes: int, channels: int, data_seed: int
) -> DataSplits:
    # Generated once here, not per __getitem__: cheap to read, identical on every rank.
    generator = torch.Generator().manual_seed(data_seed)
    prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=generator)

    def make(count: int) -> TensorDataset:
        labels = torch.randint(num_classes, (count,), generator=generator)
        noise = torch.randn(count, channels, image_size, image_size, generator=generator)
        return TensorDataset(prototypes[labels] + 2.0 * noise, labels)

    return DataSplits(make(num_samples), make(num_val_samples), num_classes=num_classes, in_channels=channels)
