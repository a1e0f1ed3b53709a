"""A batch as the loader yields it: any nesting of tuples, lists and dicts of tensors, e.g.
(images, labels), ((view_1, view_2), labels) or {"image": images, "label": labels}. The loop moves it
as a whole and counts its samples from its size, whatever the task does with it.

Where a sample's (or a batch's) image and label are, by its structure (docs/tasks.md#batches):
element 0 and 1 of a tuple or list; the IMAGE_KEY and LABEL_KEY entries of a dict. The startup check
tries the model on a sample's image; the default task steps read a batch's images and labels."""

from dataclasses import dataclass
from typing import Any

import torch

from ddp.config.schema import ConfigError

IMAGE_KEY, LABEL_KEY = "image", "label"


class ImageNormalization:
    """A dataset's per-channel mean and std, and the transform's last step that applies them: a uint8
    image (C, H, W), or a batch of them, to contiguous float32 in [0, 1], then (x - mean) / std, the very operations
    of transforms.v2's ToDtype(scale=True) and Normalize. An element's value doesn't depend on where or
    in what batch it is computed, so applying it per image or per batch on the device gives the same bits.

    In the repo's loader workers it is `deferred` (ddp/loading/loader_workers.py): images leave the
    workers as uint8, a quarter of float32's bytes through shared memory, and `to_device` normalizes
    the batch on the device. Everywhere else (data.num_workers=0, a dataset indexed directly, a user's
    own DataLoader) the transform's images are float32, as before."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.mean, self.std, self.deferred = tuple(mean), tuple(std), False
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # on each device, made once

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image if self.deferred else self.apply(image)

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        if images.device not in self._constants:
            self._constants[images.device] = tuple(torch.tensor(values, dtype=torch.float32, device=images.device).view(-1, 1, 1)
                                                   for values in (self.mean, self.std))
        mean, std = self._constants[images.device]
        # contiguous: a loader worker's batch of decoded images is channels_last (ddp/loading/collate.py),
        # transposed here in the same pass as the conversion
        return images.to(torch.float32, memory_format=torch.contiguous_format).mul_(1.0 / 255).sub_(mean).div_(std)

    def __getstate__(self) -> dict:  # to a loader worker: no device's tensors
        return {"mean": self.mean, "std": self.std, "deferred": self.deferred, "_constants": {}}

    def __repr__(self) -> str:
        return f"ImageNormalization(mean={self.mean}, std={self.std})"


class SampleList(list):
    """A batch's per-sample items left uncollated: images of different sizes, a detector's targets
    (data/detection_transforms.py: detection_collate). Its samples are its length, not its first tensor's leading size."""


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format = torch.preserve_format,
              normalization: ImageNormalization | None = None) -> Any:
    """`batch` on `device`, same nesting; its image tensors (4-D floating point) in `memory_format`.
    With the dataset's `normalization`, 4-D uint8 tensors are images a loader worker left to it: moved
    as uint8, then normalized on the device."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 4 and batch.dtype == torch.uint8 and normalization is not None:
            return normalization.apply(batch.to(device, non_blocking=True)).to(memory_format=memory_format)
        if batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=True, memory_format=memory_format)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(item, device, memory_format, normalization) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device, memory_format, normalization) for key, value in batch.items()}
    return batch


@dataclass(frozen=True)
class BatchPlacement:
    """How the training step puts a batch on its device: image tensors channels_last (channels_last=true)
    or contiguous, and the uint8 images that loader workers hand over normalized with the dataset's
    `normalization`, after the data-wait meter has timed their arrival."""

    channels_last: bool = False
    normalization: ImageNormalization | None = None

    def __call__(self, batch: Any, device: torch.device) -> Any:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        return to_device(batch, device, memory_format, self.normalization)


def batch_size(batch: Any) -> int:
    """The number of samples: the leading size of the batch's first tensor, or the length of its first SampleList."""
    if isinstance(batch, SampleList):
        return len(batch)
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


def structure(sample: Any) -> str:
    """How a sample or batch is built, for an error line: "a dict with keys ['img', 'y']", "a tuple of 3"."""
    if isinstance(sample, dict):
        return f"a dict with keys {sorted(map(str, sample))}"
    if isinstance(sample, (tuple, list)):
        return f"a {type(sample).__name__} of {len(sample)}"
    return f"a {type(sample).__name__}"


def sample_image(sample: Any) -> Any:
    """A dataset sample's image: element 0 of a tuple or list, a dict's IMAGE_KEY."""
    if isinstance(sample, (tuple, list)) and len(sample) > 0:
        return sample[0]
    if isinstance(sample, dict) and IMAGE_KEY in sample:
        return sample[IMAGE_KEY]
    raise ConfigError(f"data: a sample is {structure(sample)}, and its image is looked for as element 0 of a tuple "
                      f"or list, or as a dict's '{IMAGE_KEY}'; return samples as (image, label) or as a dict with "
                      f"'{IMAGE_KEY}' and '{LABEL_KEY}' keys (docs/tasks.md#batches)")


def images_and_labels(batch: Any) -> tuple[Any, Any]:
    """A batch's (or sample's) images and labels: a pair's two elements, a dict's IMAGE_KEY and LABEL_KEY."""
    if not isinstance(batch, dict):
        images, labels = batch
        if isinstance(labels, SampleList):
            raise ConfigError("data: its batches hold a target dict per image (a detection dataset), which this task "
                              "can't read; use task=detection, or data of this task")
        return images, labels
    if IMAGE_KEY not in batch or LABEL_KEY not in batch:
        raise ConfigError(f"data: a batch is {structure(batch)}; the task reads a dict batch's '{IMAGE_KEY}' and "
                          f"'{LABEL_KEY}': return samples with both keys, or use a task whose steps read yours "
                          "(docs/tasks.md#batches)")
    return batch[IMAGE_KEY], batch[LABEL_KEY]
