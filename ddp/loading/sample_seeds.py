"""Per-sample randomness: every random draw a sample's loading makes (crops, flips, colour jitter,
RandAugment, random erasing, SimCLR's views, segmentation's joint transforms, a user's dataset's own
draws) comes from torch's, Python's and numpy's global RNGs seeded by (run seed, epoch, the sample's
index in its dataset), and from nothing else: not the rank, the worker or what was loaded before.

So a sample gets the same augmentation at any world size and any data.num_workers, 2 ranks x B see
what 1 process x 2B sees, and a resume starts the loader at its sample without loading the ones
before it. The views of one sample are drawn one after the other from its seed, so view v is a
function of (seed, epoch, index, v) too."""

import random

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, get_worker_info

from ddp.loading.collate import CollatedBatch, start_batch

MASK_64 = (1 << 64) - 1
VALIDATION_EPOCH = -1  # a split with no epochs: the same draws at every validation


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed from the three numbers: splitmix64's finaliser over their mix, so neighbouring
    samples, epochs and run seeds get unrelated streams. Pure Python integers: about a microsecond."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & MASK_64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & MASK_64
    return mixed ^ (mixed >> 31)


class SeededSamples(Dataset):
    """`dataset`, each `__getitem__` seeded by (seed, epoch, index). The loaders wrap every split in it;
    `epoch` is set by ddp.loading.loaders.start_epoch before each epoch's iterator starts its workers.

    Seeding goes through each generator's own call (torch.default_generator.manual_seed, not
    torch.manual_seed, which seeds every CUDA device too and costs 80 times more). In a DataLoader
    worker nothing else draws from these RNGs. In the main process (data.num_workers=0) the training
    step draws from torch's (dropout, MixUp), so its state is put back after the sample; Python's and
    numpy's are left as the sample's draws leave them (the recipe draws nothing from them, and putting
    numpy's back would cost more than the seeding). A TensorDataset only indexes its tensors: it draws
    nothing, and isn't seeded (about 15 us a sample, a tenth of a framework-bound step's time at batch 32); in the
    main process its batches are indexed at once (__getitems__)."""

    def __init__(self, dataset: Dataset, seed: int, epoch: int = VALIDATION_EPOCH):
        self.dataset, self.seed, self.epoch = dataset, seed, epoch
        self.collate_fn = getattr(dataset, "collate_fn", None)  # the loaders' and one_sample_batch's
        self.image_normalization = getattr(dataset, "image_normalization", None)  # the loaders' workers' and to_device's
        self.draws = type(dataset) is not TensorDataset  # a subclass may draw in its own __getitem__

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> list:
        """A batch's samples, which the DataLoader hands to its collate_fn. A TensorDataset's, in the main process,
        come as the batch itself: each tensor indexed once with the batch's indices, the values and layout of
        default_collate's stack of the samples (32 samples of 3x16x16: about 60 us a batch, not 125). In a worker,
        or for a dataset's own collate_fn, they are samples, as for any dataset."""
        in_worker = get_worker_info() is not None
        if self.draws or self.collate_fn is not None or in_worker:
            if in_worker and self.collate_fn is None and self.image_normalization is not None and self.image_normalization.deferred:
                start_batch(len(indices))  # their decoded images straight into the batch's shared memory (ddp/loading/collate.py)
            return [self[index] for index in indices]
        positions = torch.as_tensor(indices)
        return CollatedBatch(tensor[positions] for tensor in self.dataset.tensors)

    def __getitem__(self, index: int):
        if not self.draws:
            return self.dataset[index]
        seed = sample_seed(self.seed, self.epoch, index)
        in_main_process = get_worker_info() is None
        torch_state = torch.default_generator.get_state() if in_main_process else None
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed & 0xFFFF_FFFF)  # numpy's legacy seeds are 32-bit
        try:
            return self.dataset[index]
        finally:
            if torch_state is not None:
                torch.default_generator.set_state(torch_state)
