"""scikit-learn's bundled 8x8 handwritten digits: 1,797 real images, no download."""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from data import DataSplits


def build_digits(val_fraction: float, split_seed: int) -> DataSplits:
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(labels, dtype=torch.long)
    # A fixed split, independent of the training seed, so runs are comparable.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))
    num_val = int(len(x) * val_fraction)
    val, train = order[:num_val], order[num_val:]
    return DataSplits(TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val]), num_classes=10, in_channels=1)
