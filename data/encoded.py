"""Images stored encoded (JPEG, PNG, WebP bytes) behind a reader with random access, one reader per
storage format (tar shards: data/webdataset.py; Arrow/Parquet: data/hf.py). Decoding, the label check,
bad-sample handling and the transforms live here, once, in `EncodedImages`: every format decodes the
same bytes to the same pixels as torchvision's ImageFolder does from a file, so a dataset converted to
shards trains exactly as its ImageFolder did (and gets the same per-sample draws: ddp/loading/sample_seeds.py).

A reader is a sequence of samples:
    len(reader)                 the split's sample count
    reader[index] -> (bytes, int)  the encoded image and the label (may raise BadSample: one line)
    reader.where(index) -> str  the sample's place for error lines (e.g. "train-000003.tar, key 0042")
    reader.shard_sizes          samples per shard, in order (None where there are no shards): for
                                data.shuffle_window's locality-aware order (ddp/loading/samplers.py)
    reader.prefetch(shards)     optional: start fetching these shards, ahead of their reads
    reader.worker_modules       optional: modules a loader worker needs to unpickle the reader, which
                                the workers' fork server imports once (ddp/loading/loader_workers.py)
"""

import io
import itertools

import torch
from PIL import Image
from torch.utils.data import Dataset

from data.vision import BadSample, rgb_image


def decode_image(data: bytes) -> Image.Image:
    """RGB, the pixels ImageFolder's loader gives (data/vision.py's rgb_image)."""
    return rgb_image(io.BytesIO(data))


class EncodedImages(Dataset):
    """(transform(decoded image), label) for each sample of `reader`. A label outside [0, num_classes)
    is one line naming the sample. An image that can't be decoded stops the run with one line naming it
    (on_bad_sample=error), or is replaced by the split's next readable sample, wrapping around (skip),
    which depends on the data alone: the same on every rank, epoch and resume. `skipped` flags each
    replaced index, in shared memory so that DataLoader workers' flags reach the rank. `decode` turns a
    sample's bytes into what the transform takes (a format storing tensors passes its own; it raises
    ValueError for bytes it can't read). `image_normalization`: the transform's last step, which the
    loaders' uint8 batches get on the device (ddp/loading/batches.py)."""

    def __init__(self, reader, transform, num_classes: int, split: str, on_bad_sample: str, decode=decode_image,
                 image_normalization=None):
        self.reader, self.transform, self.num_classes, self.decode = reader, transform, num_classes, decode
        self.image_normalization = image_normalization
        self.split, self.on_bad_sample = split, on_bad_sample
        self.skipped = torch.zeros(len(reader), dtype=torch.uint8).share_memory_()

    @property
    def shard_sizes(self) -> list[int] | None:
        return self.reader.shard_sizes

    @property
    def prefetch(self):
        return getattr(self.reader, "prefetch", None)

    @property
    def worker_modules(self) -> tuple[str, ...]:
        return getattr(self.reader, "worker_modules", ())

    def __len__(self) -> int:
        return len(self.reader)

    def where(self, index: int) -> str:
        return self.reader.where(index)

    def __getitem__(self, index: int):
        for candidate in itertools.chain(range(index, len(self.reader)), range(index)):
            data, label = self.reader[candidate]
            if not 0 <= label < self.num_classes:
                raise BadSample(f"{self.reader.where(candidate)} ({self.split} split): label {label} is outside "
                                f"[0, {self.num_classes}); fix the shard's label, or the dataset's class count")
            try:
                image = self.decode(data)
            except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for broken bytes
                if self.on_bad_sample == "error":
                    raise BadSample(f"{self.reader.where(candidate)} ({self.split} split): unreadable image "
                                    f"({type(error).__name__}: {error}); replace the sample, or set "
                                    "data.on_bad_sample=skip") from None
                self.skipped[candidate] = 1
                continue
            return (self.transform(image) if self.transform is not None else image), label
        raise BadSample(f"no readable image in the {self.split} split (data.on_bad_sample=skip)")
