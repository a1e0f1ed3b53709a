"""scikit-learn's bundled 8x8 handwritten digits: 1,797 real images, no download."""

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from data import DataSplits
from data.views import check_views, tensor_views
from ddp.config.schema import ConfigError


def build_digits(val_fraction: float, split_seed: int, augment: bool = False, views: int = 1) -> DataSplits:
    """augment: each view's own random crop (data/views.py), with views >= 2 only: the single-image
    digits have no augmentation."""
    check_views(views)
    if augment and views == 1:
        raise ConfigError("data.augment=true: data=digits augments only the views of data.views >= 2; "
                          "set data.augment=false, or data.views=2")
    images, labels = bundled_digits()
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(labels, dtype=torch.long)
    # A fixed split, independent of the training seed, so runs are comparable.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))
    num_val = int(len(x) * val_fraction)
    val, train = order[:num_val], order[num_val:]
    train_split = TensorDataset(x[train], y[train])
    if views > 1:
        train_split = tensor_views(train_split, x.shape[-1], augment, views, strokes=True)
    return DataSplits(train_split, TensorDataset(x[val], y[val]), num_classes=10, in_channels=1)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of scikit-learn's digits.csv.gz, read as its load_digits reads them, without importing
    scikit-learn: its import (scipy's with it) costs about 1.5 s of CPU in every rank of every run."""
    package = Path(importlib.util.find_spec("sklearn").origin).parent  # found, not imported
    with gzip.open(package / "datasets" / "data" / "digits.csv.gz") as table_file:
        table = np.loadtxt(table_file, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)
