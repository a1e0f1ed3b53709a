"""A dataset for loader tests, in a module of its own: each loader worker imports the dataset's
module, and this one costs milliseconds where a test module (with all that it imports) costs seconds."""

import os
import random
import resource

import numpy as np
import torch
from torch.utils.data import Dataset


class IdsAndNoise(Dataset):
    """Sample i is (i, a draw from each of torch's, Python's and numpy's global RNGs of the loading
    process), like a random augmentation. `loads[i]` counts the loads of sample i, in any process
    (shared memory, as the loader's workers are other processes). `shard_sizes`: as a sharded dataset
    stores its samples (data/encoded.py), for data.shuffle_window."""

    def __init__(self, size: int = 50, shard_sizes: list[int] | None = None):
        self.loads = torch.zeros(size, dtype=torch.int32).share_memory_()
        self.shard_sizes = shard_sizes

    def __len__(self) -> int:
        return len(self.loads)

    def __getitem__(self, index):
        self.loads[index] += 1
        return index, torch.stack([torch.rand((), dtype=torch.float64), torch.tensor(random.random()),
                                   torch.tensor(np.random.rand())])


class LargeViews(Dataset):
    """Sample i is ((two views of 3x320x320 uint8, the values a function of i), i, a dict with one more
    view): a batch of 4 holds tensors of 1.2 MB, above the size that loader workers stack into shared
    memory made ready ahead (ddp/loading/collate.py)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        views = [torch.randint(0, 256, (3, 320, 320), dtype=torch.uint8, generator=generator) for _ in range(3)]
        return (views[0], views[1]), index, {"image": views[2]}


class PageFaults(Dataset):
    """`dataset`'s samples; `faults[i]`: the minor page faults that the thread loading sample i took while
    it loaded it (shared memory, as the loader's workers are other processes)."""

    def __init__(self, dataset: Dataset):
        self.dataset, self.image_normalization = dataset, dataset.image_normalization
        self.faults = torch.full((len(dataset),), -1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        sample = self.dataset[index]
        self.faults[index] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        return sample


class ImageSegments(Dataset):
    """`dataset`'s (image, label) samples; `segments[i]`: (the inode of the shared-memory segment that sample i's
    image lies in, its offset there, in bytes), or (-1, -1) where it lies in private memory. Shared memory, as the
    loader's workers are other processes."""

    def __init__(self, dataset: Dataset):
        self.dataset, self.image_normalization = dataset, dataset.image_normalization
        self.segments = torch.full((len(dataset), 2), -1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        self.segments[index] = torch.tensor(segment_of(image))
        return image, label


def segment_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(inode of the shared-memory segment that `tensor` lies in, its offset there in bytes), or (-1, -1)."""
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        return -1, -1
    fd, _ = storage._share_fd_cpu_()
    return os.fstat(fd).st_ino, tensor.storage_offset() * tensor.element_size()
