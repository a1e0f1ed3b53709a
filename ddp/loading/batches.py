"""A batch as the loader yields it: any nesting of tuples, lists and dicts of tensors, e.g.
(images, labels) or ((view_1, view_2), labels). The loop moves it as a whole and counts its samples
from its size, whatever the task does with it."""

from typing import Any

import torch


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format = torch.preserve_format) -> Any:
    """`batch` on `device`, same nesting; its image tensors (4-D floating point) in `memory_format`."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=True, memory_format=memory_format)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(item, device, memory_format) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device, memory_format) for key, value in batch.items()}
    return batch


def batch_size(batch: Any) -> int:
    """The number of samples: the leading size of the batch's first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        size = batch_size(item)
        if size >= 0:
            return size
    return -1


def one_sample_batch(dataset, index: int = 0) -> Any:
    """Sample `index` of `dataset` as a batch of one, collated as the loaders collate it."""
    from torch.utils.data import default_collate

    return (getattr(dataset, "collate_fn", None) or default_collate)([dataset[index]])
