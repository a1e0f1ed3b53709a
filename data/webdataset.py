"""Tar shards in WebDataset's layout, read as a map-style dataset (`data=webdataset`; docs/sharded-data.md).

A sample is the tar members sharing a key (the member's path up to the first dot of its name): the
image under one of IMAGE_EXTENSIONS (or a tensor under TENSOR_EXTENSION, which python -m data.shards
writes for tensor datasets) and its label under `cls`, an ASCII integer; or, in detection shards
(the converter's dataset.json says `"task": "detection"`), its target under `json`: the image's id and
size and its annotations in COCO's form, crowd regions included. Random access goes through an index
of each shard, `<shard>.idx.json` beside it: each sample's key, the image member's data offset and
size, and the label (a detection sample's: its json member's [offset, size]). It is built on first use
by whichever process needs it (written atomically, so ranks racing on it are safe) and checked against
its shard's size and mtime on every use.

Decoding, the label check, data.on_bad_sample and the transforms are EncodedImages' (data/encoded.py),
with ImageFolder's transforms: shards written from an ImageFolder train to the very weights the folder
does. Detection samples are ShardDetections', made as data/coco.py makes them, with its transforms:
shards written from a COCO folder train to the very weights the folder does. Every bad input that can
be seen at startup (a pattern matching no file, a shard that isn't a tar, a sample without an image or
a label, a label outside the classes, a stale index, an interrupted conversion) is a one-line
ConfigError before anything starts; an unreadable image is found mid-run."""

import collections
import inspect
import io
import itertools
import json
import logging
import os
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.transforms.v2.functional import get_size

from data import DataSplits
from data.coco import annotation_tensors, target_boxes
from data.detection_transforms import (MULTISCALE_SIZES, check_sizes, detection_collate, detection_sample,
                                       eval_transforms, train_transforms)
from data.encoded import EncodedImages, decode_image
from data.presets import imagefolder_transforms
from data.shard_cache import Prefetcher, ShardCache, is_remote
from data.views import check_views
from data.vision import ON_BAD_SAMPLE, BadSample
from ddp.config.schema import ConfigError

log = logging.getLogger(__name__)

# The image extensions PIL decodes as ImageFolder would (WebDataset's own are jpg, jpeg, png, webp).
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "tif", "tiff")
TENSOR_EXTENSION = "pth"  # torch.save of a float tensor, loaded with weights_only=True
LABEL_EXTENSION = "cls"
TARGET_EXTENSION = "json"  # a detection sample's target (python -m data.shards writes it for detection datasets)
INDEX_SUFFIX = ".idx.json"
INDEX_FORMAT = 1
MANIFEST = "dataset.json"  # python -m data.shards writes it last: class names, shards and their sample counts
PARTIAL_MANIFEST = "dataset.partial.json"  # present while a conversion runs, and after one was interrupted
MAX_OPEN_SHARDS = 64  # per process: a window's shards stay open (data.shuffle_window), a full shuffle reopens


def local_shard(location: str, cache: ShardCache | None) -> Path:
    """The local file of a shard: its path, or an http(s) URL's copy in the node's cache (data/shard_cache.py),
    downloaded first where this node has none. The one place a shard is opened from."""
    return cache.fetch(location) if is_remote(location) else Path(location)


def expand_shards(pattern: str, key: str) -> list[str]:
    """The shards a brace pattern (`/data/train-{000000..000127}.tar`) or a path names: each an existing
    file, or an http(s) URL (which the cache fetches when it is first read)."""
    from braceexpand import braceexpand

    names = list(braceexpand(pattern))
    if other := [name for name in names if "://" in name and not is_remote(name)]:
        raise ConfigError(f"{key}={pattern}: {other[0]}: only local paths and http(s) URLs are read; copy the shards "
                          "to a local or mounted disk, or serve them over HTTP")
    shards = [Path(name) for name in names if not is_remote(name)]
    missing = [shard for shard in shards if not shard.is_file()]
    if missing and len(missing) == len(names):
        raise ConfigError(f"{key}={pattern}: matches no file; give a shard path or a brace pattern "
                          "such as /data/train-{000000..000127}.tar")
    if missing:
        raise ConfigError(f"{key}={pattern}: {missing[0]} does not exist ({len(missing)} of the {len(shards)} "
                          "shards the pattern names are missing); fix the pattern or copy the missing shards")
    return names


def split_member_name(name: str) -> tuple[str, str]:
    """(key, extension) as WebDataset splits a member's path: the extension is all after the first dot
    of the file name, lower-cased."""
    folder, _, file_name = name.rpartition("/")
    stem, _, extension = file_name.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower()


def build_index(shard: Path) -> dict:
    """The shard's samples in their order: [key, image extension, data offset, size, label] each, the
    label a detection sample's json member's [offset, size]. Reads the headers (tarfile seeks past the
    data) and each sample's small label member."""
    members: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tarfile.open(shard, mode="r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                key, extension = split_member_name(member.name)
                if extension in members.setdefault(key, {}):
                    raise ConfigError(f"{shard}: key {key} has two {extension} members; "
                                      "give each sample its own key and rewrite the shard")
                members[key][extension] = member
            samples = [_index_entry(shard, archive, key, files) for key, files in members.items()]
    except (tarfile.ReadError, EOFError) as error:
        raise ConfigError(f"{shard}: not a readable tar file ({error}); rewrite the shard "
                          "(python -m data.shards, or tar -cf) or leave it out of the pattern") from None
    stat = shard.stat()
    return {"format": INDEX_FORMAT, "shard_bytes": stat.st_size, "shard_mtime_ns": stat.st_mtime_ns, "samples": samples}


def _index_entry(shard: Path, archive: tarfile.TarFile, key: str, files: dict[str, tarfile.TarInfo]) -> list:
    images = [extension for extension in (*IMAGE_EXTENSIONS, TENSOR_EXTENSION) if extension in files]
    if not images:
        raise ConfigError(f"{shard}: sample {key} has no image (members: {', '.join(sorted(files))}; "
                          f"expected one of {', '.join(IMAGE_EXTENSIONS)}, or {TENSOR_EXTENSION}); "
                          "add it or remove the sample's members from the shard")
    image = files[images[0]]
    if LABEL_EXTENSION not in files and TARGET_EXTENSION in files:  # a detection sample: its target is read with it
        target = files[TARGET_EXTENSION]
        return [key, images[0], image.offset_data, image.size, [target.offset_data, target.size]]
    if LABEL_EXTENSION not in files:
        raise ConfigError(f"{shard}: sample {key} has no label (a {key}.{LABEL_EXTENSION} member holding the class "
                          f"as an integer, or a detection sample's {key}.{TARGET_EXTENSION} target); add it or remove "
                          "the sample's members from the shard")
    text = archive.extractfile(files[LABEL_EXTENSION]).read().decode("ascii", "replace").strip()
    try:
        label = int(text)
    except ValueError:
        raise ConfigError(f"{shard}: sample {key}'s {LABEL_EXTENSION} holds {text[:40]!r}, not an integer class; "
                          "fix the label in the shard") from None
    return [key, images[0], image.offset_data, image.size, label]


def load_index(shard: Path) -> dict:
    """The shard's index, read from beside it, or built and saved there when missing. One that
    disagrees with its shard is refused, naming the fix."""
    index_path = shard.with_name(shard.name + INDEX_SUFFIX)
    if not index_path.exists():
        index = build_index(shard)
        _save_atomically(index_path, index)
        return index
    index = read_index(index_path)
    stat = shard.stat()
    recorded = (index["format"], index["shard_bytes"], index["shard_mtime_ns"])
    if recorded != (INDEX_FORMAT, stat.st_size, stat.st_mtime_ns):
        raise ConfigError(f"{index_path}: disagrees with its shard {shard.name} (written for {recorded[1]} bytes modified "
                          f"at {recorded[2]} ns, format {recorded[0]}; the shard has {stat.st_size} bytes modified at "
                          f"{stat.st_mtime_ns} ns); delete the index to rebuild it from the shard")
    return index


def read_index(index_path: Path, name: str | None = None) -> dict:
    """An index file, refused if it isn't one or if a sample lies past its shard's end. name: where the
    error lines say it came from (a served index's URL)."""
    name = name or str(index_path)
    try:
        index = json.loads(index_path.read_text())
        index_format, shard_bytes, _, samples = (index[key] for key in ("format", "shard_bytes", "shard_mtime_ns", "samples"))
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{name}: not a readable shard index ({type(error).__name__}: {error}); "
                          "delete the index to rebuild it from the shard") from None
    if index_format != INDEX_FORMAT or any(offset + size > shard_bytes or (isinstance(label, list) and sum(label) > shard_bytes)
                                           for _, _, offset, size, label in samples):
        raise ConfigError(f"{name}: disagrees with its shard (format {index_format}, or a sample beyond the shard's "
                          f"{shard_bytes} bytes); delete the index to rebuild it from the shard")
    return index


def shard_index(location: str, cache: ShardCache | None) -> dict:
    """A shard's index. For an http(s) shard, the index the server has beside it (`<url>.idx.json`, which
    the converter writes) comes through the cache, so that no shard is downloaded to start a run; the
    copy's size is checked against it when the shard is read. Without one, the shard is downloaded and
    its index built from the copy."""
    if is_remote(location) and (served := cache.fetch(location + INDEX_SUFFIX, missing_ok=True)) is not None:
        return read_index(served, location + INDEX_SUFFIX)
    return load_index(local_shard(location, cache))


def _save_atomically(path: Path, index: dict) -> None:
    """tmp file, then os.replace: a reader sees no index or a whole one. Ranks building the same index
    at once write the same content, each through its own tmp file. A read-only folder keeps it in memory."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                                         delete=False) as tmp:
            json.dump(index, tmp)
        os.replace(tmp.name, path)
    except OSError as error:
        log.warning("%s: can't save the shard index (%s); it is rebuilt at every start", path, error)


class ShardReader:
    """The samples of a split's shards, in shard order then tar order, read by index: a reader for
    EncodedImages (data/encoded.py). Shard files are opened lazily by each process (DataLoader workers
    included), at most MAX_OPEN_SHARDS at a time (the least recently read closes: file descriptors are
    limited, and a remote shard evicted from the cache frees its disk once closed), and read with
    os.pread, so no descriptor or file offset is shared across processes."""

    def __init__(self, shards: list[str], indexes: list[dict], cache: ShardCache | None = None):
        self._files: collections.OrderedDict[int, int] = collections.OrderedDict()  # first: what close() reads
        self._prefetcher: Prefetcher | None = None
        self._pid = os.getpid()
        self.shards, self.cache = shards, cache
        self.samples = [(shard_number, *sample) for shard_number, index in enumerate(indexes) for sample in index["samples"]]
        self.shard_sizes = [len(index["samples"]) for index in indexes]
        self.shard_bytes = [index["shard_bytes"] for index in indexes]

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self) -> dict:
        # descriptors and the prefetch thread don't travel to another process
        return {**self.__dict__, "_files": collections.OrderedDict(), "_prefetcher": None}

    def where(self, index: int) -> str:
        shard_number, key = self.samples[index][:2]
        return f"{self.shards[shard_number]}, key {key} (index {index})"

    def label(self, index: int) -> int:
        return self.samples[index][5]

    def extension(self, index: int) -> str:
        return self.samples[index][2]

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        shard_number, _, _, offset, size, label = self.samples[index]
        return self._read(shard_number, offset, size, index), label

    def target(self, index: int) -> bytes:
        """A detection sample's json target (its index entry holds the member's [offset, size] as the label)."""
        shard_number, *_, (offset, size) = self.samples[index]
        return self._read(shard_number, offset, size, index)

    def _read(self, shard_number: int, offset: int, size: int, index: int) -> bytes:
        data = os.pread(self._file(shard_number), size, offset)
        if len(data) != size:
            raise BadSample(f"{self.where(index)}: the shard ends before the sample ({len(data)} of {size} bytes); "
                            "the shard changed after its index was built: delete its index to rebuild it")
        return data

    def prefetch(self, shard_numbers: list[int]) -> None:
        """Start downloading these shards into the cache, in the background (remote shards only: a local
        shard is read where it lies)."""
        urls = [self.shards[number] for number in shard_numbers if is_remote(self.shards[number])]
        if urls:
            self._in_this_process()
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self.cache)
            self._prefetcher(urls)

    def close(self) -> None:
        """Close the shard files this process opened (a later read opens them again)."""
        if self._pid == os.getpid():  # a forked child's copy of the dict names its parent's
            while self._files:
                os.close(self._files.popitem()[1])

    def __del__(self, finalizing=sys.is_finalizing) -> None:  # bound now: at the exit, the module's names may be gone
        # a dropped reader's descriptors are plain integers that nothing else closes: without this, each
        # job of a sweep in one process (hydra -m) would keep its shards open, up to MAX_OPEN_SHARDS a job.
        # At the interpreter's exit they close with the process
        if not finalizing():
            self.close()

    def _in_this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: its parent's descriptors and thread are the parent's
            self._files, self._prefetcher, self._pid = collections.OrderedDict(), None, os.getpid()

    def _file(self, shard_number: int) -> int:
        self._in_this_process()
        if shard_number in self._files:
            self._files.move_to_end(shard_number)
            return self._files[shard_number]
        if len(self._files) >= MAX_OPEN_SHARDS:
            os.close(self._files.popitem(last=False)[1])
        location = self.shards[shard_number]
        descriptor = os.open(local_shard(location, self.cache), os.O_RDONLY)
        if is_remote(location) and (copied := os.fstat(descriptor).st_size) != self.shard_bytes[shard_number]:
            os.close(descriptor)
            raise BadSample(f"{location}{INDEX_SUFFIX}: disagrees with its shard (written for {self.shard_bytes[shard_number]} "
                            f"bytes; the server's shard has {copied}); write the index again beside the served shard "
                            "(python -m data.shards writes both), or remove it there")
        self._files[shard_number] = descriptor
        return descriptor


def load_tensor(data: bytes) -> torch.Tensor:
    """A TENSOR_EXTENSION sample: a tensor saved with torch.save, loaded without running pickled code."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # unpickling errors, RuntimeError for a broken zip: EncodedImages' bad sample
        raise ValueError(f"not a saved tensor ({type(error).__name__})") from None


def read_manifest(shards: list[str], key: str, cache: ShardCache | None = None) -> dict | None:
    """The converter's dataset.json beside the shards (for http(s) shards, beside them on the server), or
    None for shards written by other tools. Shards of an interrupted conversion are refused."""
    folder = shards[0].rsplit("/", 1)[0] if "/" in shards[0] else "."
    if is_remote(folder):
        partial, manifest = (cache.read(f"{folder}/{name}", missing_ok=True) for name in (PARTIAL_MANIFEST, MANIFEST))
    else:
        partial, manifest = ((Path(folder) / name).read_bytes() if (Path(folder) / name).exists() else None
                             for name in (PARTIAL_MANIFEST, MANIFEST))
    if partial is not None:
        raise ConfigError(f"{key}: {folder} holds an interrupted conversion ({PARTIAL_MANIFEST}, no {MANIFEST}); "
                          f"run python -m data.shards {folder} ... again to finish it")
    if manifest is None:
        return None
    try:
        return json.loads(manifest)
    except ValueError as error:
        raise ConfigError(f"{folder}/{MANIFEST}: not readable JSON ({error}); write the shards again with "
                          "python -m data.shards") from None


def manifest_digests(manifest: dict, shards: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """The (bytes, CRC-32) that dataset.json lists for each remote shard of its folder; none for shards it lists
    without them (converted before digests) or that lie elsewhere."""
    folder = shards["train"][0].rsplit("/", 1)[0]
    listed = {name: (size, crc) for split in manifest.get("splits", {}).values()
              for name, size, crc in zip(split["shards"], split.get("bytes", []), split.get("crc32", []))}
    return {path: listed[name] for paths in shards.values() for path in paths
            if is_remote(path) and (name := path.rsplit("/", 1)[-1]) in listed and path.rsplit("/", 1)[0] == folder}


def check_against_manifest(manifest: dict, split: str, shards: list[str], indexes: list[dict]) -> None:
    """A shard the manifest lists must hold the samples it counted (a shard replaced since is refused)."""
    listed = manifest.get("splits", {}).get(split, {})
    counts = dict(zip(listed.get("shards", []), listed.get("samples", [])))
    for shard, index in zip(shards, indexes):
        name = shard.rsplit("/", 1)[-1]
        if name in counts and counts[name] != len(index["samples"]):
            raise ConfigError(f"{shard}: holds {len(index['samples'])} samples where its folder's {MANIFEST} counts "
                              f"{counts[name]}; write the shards again with python -m data.shards")


def build_webdataset(train_shards: str, val_shards: str, image_size: int = 224, augment: str | bool = "standard",
                     random_erase: float = 0.0, interpolation: str = "bilinear", on_bad_sample: str = "error",
                     views: int = 1, num_classes: int | None = None, test_shards: str | None = None,
                     cache_dir: str | None = None, cache_limit_gb: float | None = None,
                     multiscale_sizes: list[int] | None = None, multiscale_max_size: int | None = 1333,
                     lsj_size: int = 1024) -> DataSplits:
    """The shards of each split (brace patterns, paths or http(s) URLs), decoded and transformed as
    data=imagefolder does. num_classes: data.num_classes, else the converter's dataset.json, else the
    largest label + 1. Remote shards are read through a cache in cache_dir, within cache_limit_gb.
    Detection shards (their dataset.json says so) are read as data=coco reads its folder: `augment` is
    one of its presets, multiscale_sizes, multiscale_max_size and lsj_size are its options (and take its
    defaults), and the options that only one kind of shards takes stay at their defaults for the other."""
    check_views(views)
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ConfigError(f"data.on_bad_sample={on_bad_sample}: must be one of {' | '.join(ON_BAD_SAMPLE)}")
    patterns = {"train": train_shards, "val": val_shards, "test": test_shards}
    shards = {split: expand_shards(pattern, f"data.{split}_shards") for split, pattern in patterns.items() if pattern}
    cache = ShardCache(cache_dir, cache_limit_gb) if cache_dir else None
    if cache is None and any(is_remote(name) for names in shards.values() for name in names):
        raise ConfigError("data.cache_dir=null: http(s) shards are read from a local copy; set data.cache_dir to a "
                          "folder on a local disk that the ranks of a node share, e.g. data.cache_dir=/tmp/shards")
    manifest = read_manifest(shards["train"], "data.train_shards", cache)
    detection = manifest is not None and manifest.get("task") == "detection"
    if detection:
        refuse_unused("detection", image_size=image_size, random_erase=random_erase, interpolation=interpolation,
                      views=views, on_bad_sample=on_bad_sample)
    else:
        refuse_unused("classification", multiscale_sizes=multiscale_sizes, multiscale_max_size=multiscale_max_size,
                      lsj_size=lsj_size)
    if manifest is not None and cache is not None:
        cache.expect(manifest_digests(manifest, shards))
    readers, manifests = {}, {"train": manifest}
    for split, paths in shards.items():
        if split != "train":  # an interrupted conversion there too
            manifests[split] = read_manifest(paths, f"data.{split}_shards", cache)
        indexes = [shard_index(path, cache) for path in paths]
        if manifest is not None:
            check_against_manifest(manifest, split, paths, indexes)
        readers[split] = ShardReader(paths, indexes, cache)
    if detection:
        return _detection_splits(readers, manifests, num_classes, augment, multiscale_sizes, multiscale_max_size, lsj_size)
    num_classes, class_names = _classes(readers, manifest, num_classes)
    tensors = readers["train"].extension(0) == TENSOR_EXTENSION if len(readers["train"]) else False
    if tensors:
        transforms = _tensor_transforms(augment, views)
        in_channels = load_tensor(readers["train"][0][0]).shape[0]
        per_format = {"decode": load_tensor}
    else:
        train_transform, eval_transform, normalization = imagefolder_transforms(image_size, augment, random_erase, interpolation, views)
        transforms = {"train": train_transform, "val": eval_transform, "test": eval_transform}
        in_channels = 3
        per_format = {"image_normalization": normalization}
    splits = {split: EncodedImages(reader, transforms[split], num_classes, split, on_bad_sample, **per_format)
              for split, reader in readers.items()}
    return DataSplits(splits["train"], splits["val"], num_classes=num_classes, in_channels=in_channels,
                      test=splits.get("test"), class_names=class_names)


def refuse_unused(kind: str, **options) -> None:
    """Options that only the other kind of shards takes must be at build_webdataset's defaults: a value
    set for them here would be ignored without a word."""
    parameters = inspect.signature(build_webdataset).parameters
    for key, value in options.items():
        if value != parameters[key].default:
            raise ConfigError(f"data.{key}={value}: these shards hold {kind} samples, which don't take it "
                              f"(its default: {parameters[key].default}); remove data.{key}")


def _detection_splits(readers: dict[str, ShardReader], manifests: dict[str, dict | None], num_classes: int | None,
                      augment: str, multiscale_sizes: list[int] | None, multiscale_max_size: int | None,
                      lsj_size: int) -> DataSplits:
    """Detection shards' splits, as build_coco makes a folder's: training samples get the `augment`
    preset (multiscale_sizes null: the references' 480, 512, ..., 800), the others none; classes are
    the manifest's categories and the background."""
    manifest = manifests["train"]
    if num_classes is not None and num_classes != manifest["num_classes"]:
        raise ConfigError(f"data.num_classes={num_classes}: detection shards' classes are their {MANIFEST}'s categories "
                          f"and the background ({manifest['num_classes']}); remove data.num_classes")
    multiscale_sizes = MULTISCALE_SIZES if multiscale_sizes is None else multiscale_sizes
    check_sizes(multiscale_sizes, multiscale_max_size, lsj_size)
    transforms = {"train": train_transforms(augment, multiscale_sizes, multiscale_max_size, lsj_size),
                  "val": eval_transforms(), "test": eval_transforms()}
    splits = {}
    for split, reader in readers.items():
        key = f"data.{split}_shards"
        for index in range(len(reader)):
            if not isinstance(reader.label(index), list):
                raise ConfigError(f"{reader.where(index)}: a {LABEL_EXTENSION} label, no {TARGET_EXTENSION} target, in shards "
                                  f"whose {MANIFEST} says detection; {key}: give shards that python -m data.shards wrote")
        image_ids, image_sizes = shard_images(manifests[split], manifest["categories"], reader, key)
        splits[split] = ShardDetections(reader, transforms[split], manifest["categories"], image_ids, image_sizes)
    return DataSplits(splits["train"], splits["val"], num_classes=manifest["num_classes"], in_channels=3,
                      test=splits.get("test"), class_names=manifest["class_names"])


def shard_images(manifest: dict | None, categories: list[dict], reader: ShardReader, key: str) -> tuple[list, list]:
    """(image ids, [width, height] of each image) of the reader's samples, from the dataset.json of
    their folder, which lists them per split in sample order: a detection dataset's sample_ids and
    aspect_ratios, without reading a sample. Its shards may be some of the split's, in any order."""
    if manifest is None or manifest.get("task") != "detection" or manifest["categories"] != categories:
        raise ConfigError(f"{key}: not detection shards of the train shards' categories (see the {MANIFEST} beside "
                          "them); give shards that python -m data.shards wrote from the same detection dataset")
    listed = {}
    for split in manifest["splits"].values():
        ends = list(itertools.accumulate(split["samples"]))
        for name, start, end in zip(split["shards"], [0, *ends], ends):
            listed[name] = (split["image_ids"][start:end], split["image_sizes"][start:end])
    image_ids, image_sizes = [], []
    for shard, count in zip(reader.shards, reader.shard_sizes):
        ids, sizes = listed.get(shard.rsplit("/", 1)[-1], ([], []))
        if len(ids) != count:
            raise ConfigError(f"{shard}: holds {count} samples where the {MANIFEST} beside it lists {len(ids)}; "
                              "write the shards again with python -m data.shards")
        image_ids += ids
        image_sizes += sizes
    return image_ids, image_sizes


def _classes(readers: dict[str, ShardReader], manifest: dict | None, num_classes: int | None):
    """(num_classes, class names or None), every label checked against the count here, at startup."""
    for reader in readers.values():
        for index in range(len(reader)):
            if not isinstance(reader.label(index), int):
                raise ConfigError(f"{reader.where(index)}: a detection sample (a {TARGET_EXTENSION} target, no "
                                  f"{LABEL_EXTENSION} label) without the converter's {MANIFEST}, which says so; convert "
                                  "the dataset with python -m data.shards")
    class_names = manifest.get("class_names") if manifest else None
    if num_classes is None:
        if manifest is not None:
            num_classes = manifest["num_classes"]
        else:  # shards written by other tools: the labels say how many classes there are
            num_classes = 1 + max((reader.label(i) for reader in readers.values() for i in range(len(reader))), default=0)
    if class_names is not None and len(class_names) != num_classes:
        class_names = None  # data.num_classes overrides the manifest's classes: their names no longer fit
    for split, reader in readers.items():
        for index in range(len(reader)):
            if not 0 <= reader.label(index) < num_classes:
                raise ConfigError(f"{reader.where(index)} ({split} split): label {reader.label(index)} is outside "
                                  f"[0, {num_classes}); fix the shard's label, or set data.num_classes")
    return num_classes, class_names


def _tensor_transforms(augment: str | bool, views: int) -> dict:
    """Tensor shards (from data=digits or data=synthetic) train on their tensors as stored: the image
    transforms are for encoded images."""
    if augment not in (False, "none") or views != 1:
        raise ConfigError(f"data.augment={augment}, data.views={views}: these shards hold tensors ({TENSOR_EXTENSION}), "
                          "which train as stored; set data.augment=none data.views=1")
    return {"train": None, "val": None, "test": None}


class ShardDetections(Dataset):
    """The (image, target) samples of detection shards, made as data/coco.py's CocoDetection makes a
    folder's: the image decoded as it decodes a file (a pth sample: the stored uint8 tensor), the target
    from the json's annotations by its own functions (crowd regions left out, boxes clipped to the
    image), both through detection_sample. So shards of a COCO folder give its samples, bit for bit.
    sample_ids and aspect_ratios come from dataset.json, without reading a sample; coco_ground_truth()
    from the split's json targets, read once."""

    collate_fn = staticmethod(detection_collate)  # images differ in size, targets in their number of boxes

    def __init__(self, reader: ShardReader, transform, categories: list[dict], image_ids: list[int],
                 image_sizes: list[list[int]]):
        self.reader, self.transform = reader, transform
        self.category_ids = [category["id"] for category in categories]
        self.category_names = [category["name"] for category in categories]
        self.label = {category_id: position + 1 for position, category_id in enumerate(self.category_ids)}
        self.sample_ids = image_ids
        self.aspect_ratios = [width / height for width, height in image_sizes]
        self._ground_truth = None

    @property
    def shard_sizes(self) -> list[int]:
        return self.reader.shard_sizes

    @property
    def prefetch(self):
        return self.reader.prefetch

    def __len__(self) -> int:
        return len(self.reader)

    def where(self, index: int) -> str:
        return self.reader.where(index)

    def target(self, index: int) -> dict:
        """The sample's json target: image_id, width, height (file_name where its source has one) and
        annotations, each COCO's id, category_id, bbox [x, y, w, h], area and iscrowd."""
        try:
            record = json.loads(self.reader.target(index))
        except ValueError as error:
            raise BadSample(f"{self.where(index)}: its {TARGET_EXTENSION} target isn't JSON ({error}); "
                            "write the shard again with python -m data.shards") from None
        unknown = {annotation["category_id"] for annotation in record["annotations"]} - self.label.keys()
        if unknown:
            raise BadSample(f"{self.where(index)}: category_id {min(unknown)} isn't one of {MANIFEST}'s categories; "
                            "write the shards again with python -m data.shards")
        return record

    def __getitem__(self, index: int):
        data, _ = self.reader[index]
        record = self.target(index)
        try:
            image = load_tensor(data) if self.reader.extension(index) == TENSOR_EXTENSION else decode_image(data)
        except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for broken bytes
            raise BadSample(f"{self.where(index)}: unreadable image ({type(error).__name__}: {error}); "
                            "replace the sample") from None
        width, height = record["width"], record["height"]
        image_height, image_width = get_size(image)
        if (image_width, image_height) != (width, height):  # the boxes would be in another image's pixels
            raise BadSample(f"{self.where(index)}: the image is {image_width}x{image_height}, its {TARGET_EXTENSION} "
                            f"target says {width}x{height}; write the shard again with python -m data.shards")
        bboxes, labels, crowd = annotation_tensors(record["annotations"], self.label)
        boxes, labels = target_boxes(bboxes, labels, crowd, width, height)
        return detection_sample(self.transform, image, boxes, labels, record["image_id"])

    def coco_ground_truth(self) -> dict:
        """The split's ground truth in COCO's format, crowd regions included (iscrowd=1), boxes as stored:
        what the source dataset's coco_ground_truth() gave the converter for these images. Made once."""
        if self._ground_truth is None:
            images, annotations = [], []
            for index in range(len(self)):
                record = self.target(index)
                images.append({"id": record["image_id"],
                               **{field: record[field] for field in ("width", "height", "file_name") if field in record}})
                annotations += [{**annotation, "image_id": record["image_id"]} for annotation in record["annotations"]]
            categories = [{"id": category_id, "name": name} for category_id, name in zip(self.category_ids, self.category_names)]
            self._ground_truth = {"images": images, "annotations": annotations, "categories": categories}
        return self._ground_truth
