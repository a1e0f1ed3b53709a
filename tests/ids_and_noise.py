"""A dataset for loader tests, in a module of its own: each loader worker imports the dataset's
module, and this one costs milliseconds where a test module (with all that it imports) costs seconds."""

import torch
from torch.utils.data import Dataset


class IdsAndNoise(Dataset):
    """Sample i is (i, a draw from the loading process's RNG), like a random augmentation."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index):
        return index, torch.rand(())
