"""Batches collated in a loader worker into shared memory whose pages a thread made ready ahead.

A worker hands each batch to its rank in shared memory: torch's default_collate stacks the samples
into a new shared-memory segment, and the first write to each page of it allocates and zeroes that
page there and then. `collate` gives default_collate's batches, with two differences in a worker:

- Decoded images go straight into the batch's segment. Loading a batch (SeededSamples.__getitems__
  calls `start_batch`), the transform's UInt8Image step (data/presets.py) writes each RGB image into its
  `image_place` there,
  and a batch of images that fill their places in order is the segment itself, collated without a copy
  (32 uint8 images of 224 px: 4.8 MB a batch not copied once more).
- Any other tensor of at least READY_BYTES is stacked into a segment of its size.

Either segment is one that a thread of the worker made and wrote while the worker loaded the batch
before, so the images are written into pages that are there. Measured in a worker on 2 cores, 32 uint8
images of 224 px: the stack took 3.4 ms instead of 7.2, and a batch 72 ms instead of 77. Where a core
is idle that work is off the worker's path; where none is, the thread takes the time the worker would
have spent on it.

Decoded uint8 images (PILToTensor's (C, H, W) views of (H, W, C) memory) are stacked as they lie in
memory, so their batch is channels_last; the rank's normalization writes it contiguous."""

import math
import queue
import threading
from collections import Counter

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

READY_BYTES = 1 << 20  # smaller tensors (labels) cost little to place


class ReadySegments:
    """Shared-memory segments made and written by a thread of this process, one asked for ahead of each
    large tensor of the next batch, of the size of this batch's."""

    def __init__(self):
        self._asked: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        self._made: dict[int, queue.SimpleQueue] = {}
        self._pending: Counter = Counter()  # asked for and not yet taken, by size
        threading.Thread(target=self._make, name="collate-pages", daemon=True).start()

    def _make(self) -> None:
        while True:
            nbytes = self._asked.get()
            storage = torch.UntypedStorage._new_shared(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage).zero_()  # every page allocated now
            self._made[nbytes].put(storage)

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A segment of `nbytes` asked for earlier (waiting if it is still being made: the thread is
        then part way through what the caller would do), or None."""
        if not self._pending[nbytes]:
            return None
        self._pending[nbytes] -= 1
        return self._made[nbytes].get()

    def ask(self, nbytes: int) -> None:
        """One more segment of `nbytes`, for the next batch: asked for as this batch takes its own, so
        that the thread makes it while the worker loads the next batch."""
        self._pending[nbytes] += 1
        self._made.setdefault(nbytes, queue.SimpleQueue())
        self._asked.put(nbytes)


_segments: ReadySegments | None = None  # this worker's, made at its first batch


def _shared_segment(nbytes: int) -> torch.UntypedStorage:
    """A segment of `nbytes` made ready ahead if one was asked for, else a new one; and one more asked for."""
    global _segments
    if _segments is None:
        _segments = ReadySegments()
    storage = _segments.take(nbytes)
    _segments.ask(nbytes)
    return storage if storage is not None else torch.UntypedStorage._new_shared(nbytes)


class BatchPlaces:
    """The places of a batch's `size` images, (H, W, C) uint8 each, one after the other in one shared segment."""

    def __init__(self, size: int):
        self.size, self.taken, self.shape = size, 0, ()
        self.storage: torch.UntypedStorage | None = None

    def take(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The next image's place, or None: an image of another shape than the first's, or one past the batch."""
        if self.taken == 0:
            self.shape, self.storage = shape, _shared_segment(self.size * math.prod(shape))
        elif shape != self.shape or self.taken == self.size:
            return None
        place = torch.empty(0, dtype=torch.uint8).set_(self.storage, self.taken * math.prod(shape), shape)
        self.taken += 1
        return place

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor | None:
        """The segment as the batch of `images` ((H, W, C) each), if they are its places, in order; else None."""
        numel = math.prod(self.shape)
        if self.taken != self.size or len(images) != self.size or not all(
                image.untyped_storage().data_ptr() == self.storage.data_ptr() and image.storage_offset() == i * numel
                and image.shape == self.shape and image.is_contiguous() for i, image in enumerate(images)):
            return None
        return torch.empty(0, dtype=torch.uint8).set_(self.storage, 0, (self.size, *self.shape))


_places: BatchPlaces | None = None  # the places of the batch this worker is loading (start_batch)
_placing = True  # until a batch's images don't fill their places (each sample's views, say): then this worker stops


def start_batch(size: int) -> None:
    """In a loader worker, before loading a batch of `size` samples: their decoded images go into its segment."""
    global _places
    _places = BatchPlaces(size) if _placing else None


def image_place(height: int, width: int) -> torch.Tensor | None:
    """Where the next decoded RGB image of the batch this worker is loading goes, (H, W, 3) uint8 in the
    batch's segment (data/presets.py's UInt8Image writes it there); None outside a worker's batch."""
    return _places.take((height, width, 3)) if _places is not None else None


def _placed_batch(images: list[torch.Tensor]) -> torch.Tensor | None:
    """The batch of `images` as the segment they were written into, once; None where they weren't."""
    global _places, _placing
    if _places is None or _places.taken == 0:
        return None
    batch = _places.batch(images)
    _places, _placing = None, batch is not None
    return batch


def _collate_tensors(batch: list[torch.Tensor], *, collate_fn_map=None) -> torch.Tensor:
    elem = batch[0]
    if get_worker_info() is None or type(elem) is not torch.Tensor or elem.is_nested or elem.device.type != "cpu":
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    if elem.dtype == torch.uint8 and elem.dim() == 3 and elem.permute(1, 2, 0).is_contiguous() and not elem.is_contiguous():
        # decoded images as PILToTensor leaves them, (C, H, W) over (H, W, C) memory: the segment they were written
        # into, or stacked as they lie, a plain copy instead of a transposing one (32 at 224 px: 0.2 ms, not 3.2), into
        # a channels_last batch that the rank's normalization converts and lays out in one pass (ddp/loading/batches.py)
        images = [image.permute(1, 2, 0) for image in batch]
        placed = _placed_batch(images)
        return (placed if placed is not None else _stack_in_worker(images, collate_fn_map)).permute(0, 3, 1, 2)
    return _stack_in_worker(batch, collate_fn_map)


def _stack_in_worker(batch: list[torch.Tensor], collate_fn_map) -> torch.Tensor:
    elem = batch[0]
    nbytes = sum(tensor.nbytes for tensor in batch)
    if nbytes < READY_BYTES or nbytes != len(batch) * elem.nbytes:  # small, or sizes that torch's stack refuses in its words
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    storage = _shared_segment(nbytes)
    return torch.stack(batch, 0, out=torch.empty(0, dtype=elem.dtype).set_(storage, 0, (len(batch), *elem.shape)))


COLLATE_FN_MAP = {**default_collate_fn_map, torch.Tensor: _collate_tensors}


class CollatedBatch(list):
    """A batch that its dataset put together itself (SeededSamples.__getitems__): `collate` passes it on as a list,
    as default_collate would have made it of the batch's samples."""


def collate(batch: list):
    """torch's default_collate, its large tensors stacked into ready shared memory in a loader worker."""
    if isinstance(batch, CollatedBatch):
        return list(batch)
    return torch_collate(batch, collate_fn_map=COLLATE_FN_MAP)
