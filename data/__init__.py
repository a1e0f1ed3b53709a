"""Datasets. Each builder returns DataSplits; add one with a module here and a conf/data/<name>.yaml.
A dataset whose samples can't go through torch's default_collate (images of different sizes) names
its own in a `collate_fn` attribute, which the loaders use (ddp/loaders.py)."""

from dataclasses import dataclass

from torch.utils.data import Dataset

from ddp.config import LOADING_KEYS, ConfigError, instantiate_checked


@dataclass
class DataSplits:
    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    test: Dataset | None = None  # where the dataset has a test split (mode=eval data.split=test)
    class_names: list[str] | None = None  # one per class id, where the dataset names them (e.g. val_iou/<name>)


def build_datasets(data_cfg) -> DataSplits:
    """Call data._target_ with the dataset keys (everything but the loading keys)."""
    dataset_cfg = {key: value for key, value in data_cfg.items() if key not in LOADING_KEYS}
    splits = instantiate_checked(dataset_cfg, "data")
    for name in ("train", "val"):
        if len(getattr(splits, name)) == 0:
            raise ConfigError(f"data: the {name} split is empty; check the data.* sizes (e.g. data.num_samples, data.val_fraction)")
    return splits
