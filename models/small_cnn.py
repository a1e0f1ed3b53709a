"""A few conv + norm blocks: fast on CPU, and enough BatchNorm to make SyncBN matter."""

import math

from torch import nn

from ddp.config.schema import ConfigError

NORMS = ("batch", "group", "none")


def _norm(kind: str, width: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(width)
    if kind == "group":  # per-sample statistics: no SyncBN needed, and the same for any micro-batching
        return nn.GroupNorm(math.gcd(8, width), width)
    return nn.Identity()


class SmallCNN(nn.Module):
    fsdp_block_types = ("Conv2d", "Linear")  # strategy=fsdp shards each layer with weights as one unit (ddp/distributed/fsdp.py)

    def __init__(self, num_classes: int, in_channels: int, channels: list[int], dropout: float = 0.0, norm: str = "batch"):
        super().__init__()
        if norm not in NORMS:
            raise ConfigError(f"model.norm={norm}: unknown, use one of {', '.join(NORMS)}")
        blocks, previous = [], in_channels
        for width in channels:
            blocks += [nn.Conv2d(previous, width, 3, padding=1, bias=norm == "none"), _norm(norm, width), nn.ReLU(inplace=True)]
            previous = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(previous, num_classes))

    def forward(self, x):
        return self.head(self.features(x))
