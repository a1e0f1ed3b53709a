"""Hugging Face `datasets` image classification data on local disk (data=hf): a DatasetDict saved with
`save_to_disk`, or Parquet files. Both are Arrow tables, memory-mapped, with random access: a map-style
dataset that every sampler, exact resume and exact eval guarantee holds for. The reader hands out each
image's encoded bytes (the Image feature read with decode=False) and its label; data/encoded.py's
EncodedImages decodes them as ImageFolder decodes a file, so a dataset made of an ImageFolder's files,
in its order, trains to the same weights.

Nothing is downloaded: `datasets` is imported with HF_DATASETS_OFFLINE=1, and data.path must be a folder.
Parquet files are turned into Arrow once, in datasets' cache (HF_DATASETS_CACHE), as `load_dataset` does."""

import importlib.util
import os
import re
from pathlib import Path

from data import DataSplits
from data.encoded import EncodedImages
from data.presets import imagefolder_transforms
from data.views import check_views
from data.vision import ON_BAD_SAMPLE
from ddp.config.schema import ConfigError

INSTALL = "pip install -e '.[hf]'"
# What a Hub dataset's name looks like ("imagenet-1k", "user/name"): a path that doesn't exist and reads
# like one is most likely a name the user expected to be downloaded.
HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class ArrowImages:
    """One split as a reader for EncodedImages (data/encoded.py): `(encoded bytes, label)` by row."""

    shard_sizes = None  # one memory-mapped table: any order reads it as fast
    worker_modules = ("datasets",)  # what a loader worker imports to unpickle the table: the fork server's, once

    def __init__(self, split, image_column: str, label_column: str, location: str):
        from datasets import Image

        # decode=False: {"bytes", "path"} as stored, with no PIL image made here
        self.rows = split.cast_column(image_column, Image(decode=False)).select_columns([image_column, label_column])
        self.image_column, self.label_column, self.location = image_column, label_column, location

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        row = self.rows[index]
        return _image_bytes(row[self.image_column]), row[self.label_column]

    def where(self, index: int) -> str:
        return f"{self.location}, row {index}"


def _image_bytes(image: dict | None) -> bytes:
    """The stored bytes (save_to_disk and to_parquet embed an image given as a file path). An image without
    them gives b"", which EncodedImages reports (or skips: data.on_bad_sample) as unreadable."""
    return b"" if image is None or image["bytes"] is None else image["bytes"]


def build_hf(path: str, image_size: int, augment: str | bool, random_erase: float, interpolation: str,
             image_column: str = "image", label_column: str = "label", train_split: str = "train",
             val_split: str = "validation", on_bad_sample: str = "error", views: int = 1) -> DataSplits:
    """`path`: a folder written by DatasetDict.save_to_disk, or a folder of Parquet files named
    `<split>.parquet` or `<split>-*.parquet`; train_split and val_split name the splits. The classes are
    the label column's ClassLabel names where it has them, else max label + 1 over both splits.
    The transforms are data=imagefolder's. views >= 2: `((view_1, ..., view_n), label)` (data/views.py)."""
    check_views(views)
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ConfigError(f"data.on_bad_sample={on_bad_sample}: must be one of {' | '.join(ON_BAD_SAMPLE)}")
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"data=hf: datasets is not installed; install it with: {INSTALL}")
    names = {"train": train_split, "val": val_split}
    splits, locations = _load_splits(path, names)
    for split in splits.values():
        _check_columns(split, image_column, label_column)
    num_classes, class_names = _classes(splits, names, label_column)
    for role, split in splits.items():
        _check_labels(split, names[role], label_column, num_classes)
    train_transform, eval_transform, normalization = imagefolder_transforms(image_size, augment, random_erase, interpolation, views)
    transforms = {"train": train_transform, "val": eval_transform}
    images = {role: EncodedImages(ArrowImages(split, image_column, label_column, locations[role]), transforms[role],
                                  num_classes, names[role], on_bad_sample, image_normalization=normalization)
              for role, split in splits.items()}
    return DataSplits(images["train"], images["val"], num_classes=num_classes, in_channels=3, class_names=class_names)


def _load_splits(path: str, names: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """{"train": Dataset, "val": Dataset} from data.path, and where each is stored (for error lines)."""
    folder = Path(path)
    if not folder.is_dir():
        if not folder.exists() and HUB_NAME.match(path) and not path.startswith("."):
            raise ConfigError(f"data.path={path}: not a local folder, and nothing is downloaded; save the dataset on "
                              "a machine with internet access (load_dataset(...).save_to_disk(folder), or its Parquet "
                              "files) and set data.path to that folder")
        raise ConfigError(f"data.path={path}: no such directory; set data.path to a folder written by "
                          "DatasetDict.save_to_disk, or one holding <split>.parquet or <split>-*.parquet files")
    datasets = _import_datasets()
    if (folder / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(folder))
        _check_split_names(path, names, sorted(saved))
        return ({role: saved[name] for role, name in names.items()},
                {role: str(folder / name) for role, name in names.items()})
    parquet = sorted(folder.glob("*.parquet"))
    if not parquet:
        if (folder / "state.json").is_file():
            raise ConfigError(f"data.path={path}: one Dataset written by save_to_disk, without splits; save a "
                              "DatasetDict of the train and val splits there")
        raise ConfigError(f"data.path={path}: neither a DatasetDict written by save_to_disk (no dataset_dict.json) "
                          "nor Parquet files (<split>.parquet, <split>-*.parquet); set data.path to such a folder")
    _check_split_names(path, names, sorted({_split_of(f) for f in parquet}))
    files = {name: [str(f) for f in parquet if _split_of(f) == name] for name in names.values()}
    loaded = datasets.load_dataset("parquet", data_files=files)
    return ({role: loaded[name] for role, name in names.items()},
            {role: files[name][0] if len(files[name]) == 1 else str(folder / f"{name}-*.parquet")
             for role, name in names.items()})


def _split_of(parquet_file: Path) -> str:
    """A Parquet file's split: <split>.parquet, or <split>-*.parquet (the Hub's train-00000-of-00004.parquet).
    Split names are word characters (datasets' rule), so the first "-" ends one."""
    return parquet_file.name.removesuffix(".parquet").split("-")[0]


def _import_datasets():
    """`datasets`, offline: set before its import, as it reads the variable then. Its progress bars off:
    every rank would draw them on the console."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _check_split_names(path: str, names: dict[str, str], found: list[str]) -> None:
    for role, name in names.items():
        if name not in found:
            key = "data.train_split" if role == "train" else "data.val_split"
            raise ConfigError(f"{key}={name}: {path} has no such split (splits: {', '.join(found) or 'none'}); "
                              f"set {key} to one of them")


def _check_columns(split, image_column: str, label_column: str) -> None:
    from datasets import ClassLabel, Image, Value

    columns = ", ".join(split.column_names)
    for key, column in (("data.image_column", image_column), ("data.label_column", label_column)):
        if column not in split.column_names:
            raise ConfigError(f"{key}={column}: no such column (columns: {columns}); set {key} to one of them")
    if not isinstance(split.features[image_column], Image):
        raise ConfigError(f"data.image_column={image_column}: a column of {split.features[image_column]}, not of "
                          f"images (an Image feature; columns: {columns}); set data.image_column to the images'")
    label = split.features[label_column]
    if not (isinstance(label, ClassLabel) or (isinstance(label, Value) and label.dtype.startswith(("int", "uint")))):
        raise ConfigError(f"data.label_column={label_column}: a column of {label}, not of class ids (a ClassLabel or "
                          f"integers; columns: {columns}); set data.label_column to the labels'")


def _classes(splits: dict, names: dict[str, str], label_column: str) -> tuple[int, list[str] | None]:
    """The ClassLabel's names (train's and val's must agree: each numbers its classes), or max label + 1."""
    from datasets import ClassLabel

    features = {role: split.features[label_column] for role, split in splits.items()}
    if isinstance(features["train"], ClassLabel):
        if features["val"] != features["train"]:
            raise ConfigError(f"data.label_column={label_column}: the {names['train']} and {names['val']} splits name "
                              f"different classes ({features['train']} vs {features['val']}); "
                              "cast both to one ClassLabel")
        return features["train"].num_classes, list(features["train"].names)
    highest = max(_label_range(split, label_column)[1] for split in splits.values())
    return highest + 1, None


def _label_range(split, label_column: str) -> tuple[int, int]:
    """(lowest, highest) label, from the Arrow column (no row is decoded); a missing label counts as -1."""
    import pyarrow.compute

    labels = split.with_format("arrow")[label_column]
    if labels.null_count:
        return -1, -1
    extremes = pyarrow.compute.min_max(labels).as_py()
    if extremes["min"] is None:  # an empty split: data.build_datasets names it
        return 0, -1
    return extremes["min"], extremes["max"]


def _check_labels(split, name: str, label_column: str, num_classes: int) -> None:
    lowest, highest = _label_range(split, label_column)
    if lowest < 0 or highest >= num_classes:
        bad = lowest if lowest < 0 else highest
        raise ConfigError(f"data.label_column={label_column}: the {name} split holds label {bad}, outside "
                          f"[0, {num_classes}) (-1 or none: an unlabelled sample); fix or drop those rows")
