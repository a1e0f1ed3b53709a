"""Datasets. Each builder returns DataSplits and takes its options as keyword arguments, checked
against its own signature (ddp.config.builder_options); add one with a module here and a
conf/data/<name>.yaml. A sample is (image, label) or {"image": image, "label": label}
(ddp/loading/batches.py). A dataset whose samples can't go through torch's default_collate (images of
different sizes) names its own in a `collate_fn` attribute, which the loaders use (ddp/loading/loaders.py)."""

import logging
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ddp.config.builder_options import builder_options, instantiate_checked
from ddp.config.schema import ConfigError
from ddp.distributed.process_group import all_reduce_sum

log = logging.getLogger(__name__)


@dataclass
class DataSplits:
    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    test: Dataset | None = None  # where the dataset has a test split (mode=eval data.split=test)
    class_names: list[str] | None = None  # one per class id, where the dataset names them (e.g. val_iou/<name>)


def build_datasets(data_cfg) -> DataSplits:
    """Call data._target_ with its options (every data.* key but the loading keys)."""
    splits = instantiate_checked(builder_options(data_cfg, "data"), "data")
    for name in ("train", "val"):
        if len(getattr(splits, name)) == 0:
            raise ConfigError(f"data: the {name} split is empty; check the data.* sizes (e.g. data.num_samples, data.val_fraction)")
    window = data_cfg.get("shuffle_window", 0)
    if window and getattr(splits.train, "shard_sizes", None) is None:
        raise ConfigError(f"data.shuffle_window={window}: goes through a dataset's shards {window} at a time, but "
                          f"{data_cfg._target_} has no shards; use data.shuffle_window=0, or a sharded dataset (data=webdataset)")
    groups, ratios = data_cfg.get("aspect_ratio_groups", 0), getattr(splits.train, "aspect_ratios", None)
    if groups and (ratios is None or len(ratios) != len(splits.train)):
        raise ConfigError(f"data.aspect_ratio_groups={groups}: groups images by aspect ratio, but {data_cfg._target_} has no "
                          "`aspect_ratios` (one per training image); use data.aspect_ratio_groups=0, or a detection dataset")
    return splits


def report_skipped_samples(splits: DataSplits, device: torch.device) -> int | None:
    """How many distinct files of the train and val splits data.on_bad_sample=skip replaced in this run,
    on any rank (one all_reduce), with a warning naming them; None for datasets that skip nothing.
    (data/vision.py's CheckedImageFolder and data/encoded.py's EncodedImages mark them in `skipped` and
    name them with `where`; no import of them here, which would import torchvision in every run.)"""
    folders = [dataset for dataset in (splits.train, splits.val) if getattr(dataset, "on_bad_sample", None) == "skip"]
    if not folders:
        return None
    skipped = all_reduce_sum(torch.cat([folder.skipped for folder in folders]).to(device, torch.int32))
    paths = [folder.where(index) for folder, flags in zip(folders, skipped.split([len(f) for f in folders]))
             for index in flags.nonzero().flatten().tolist()]
    if paths:
        log.warning("data.on_bad_sample=skip: replaced %d unreadable image(s) by the next one of their split: %s%s",
                    len(paths), ", ".join(paths[:10]), " ..." if len(paths) > 10 else "")
    return len(paths)
