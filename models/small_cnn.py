"""A few conv + BatchNorm blocks: fast on CPU, and enough BatchNorm to make SyncBN matter."""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, channels: list[int], dropout: float = 0.0):
        super().__init__()
        blocks, previous = [], in_channels
        for width in channels:
            blocks += [nn.Conv2d(previous, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            previous = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(previous, num_classes))

    def forward(self, x):
        return self.head(self.features(x))
