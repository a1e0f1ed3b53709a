"""Datasets. Each builder returns DataSplits; add one with a module here and a conf/data/<name>.yaml."""

from dataclasses import dataclass

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import Dataset

from ddp.config import LOADER_KEYS, ConfigError


@dataclass
class DataSplits:
    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int


def build_datasets(data_cfg) -> DataSplits:
    """Call data._target_ with the dataset keys (everything but the loader keys)."""
    dataset_cfg = {key: value for key, value in data_cfg.items() if key not in LOADER_KEYS}
    try:
        splits = instantiate(dataset_cfg)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):  # the builder's own clear message, not Hydra's wrapper
            raise error.__cause__ from None
        raise
    for name in ("train", "val"):
        if len(getattr(splits, name)) == 0:
            raise ConfigError(f"data: the {name} split is empty; check the data.* sizes (e.g. data.num_samples, data.val_fraction)")
    return splits
