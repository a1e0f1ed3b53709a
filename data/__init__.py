"""Datasets. Each builder returns DataSplits and takes its options as keyword arguments, checked
against its own signature (ddp.builder_options); add one with a module here and a
conf/data/<name>.yaml. A dataset whose samples can't go through torch's default_collate (images of
different sizes) names its own in a `collate_fn` attribute, which the loaders use (ddp/loaders.py)."""

from dataclasses import dataclass

from torch.utils.data import Dataset

from ddp.builder_options import builder_options, instantiate_checked
from ddp.config import ConfigError


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
    return splits
