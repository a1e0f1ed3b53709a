"""torchvision's ResNet-18, randomly initialised (no weight download)."""

from torch import nn

from models.zoo import build_torchvision


def build_resnet18(num_classes: int, in_channels: int, small_input: bool) -> nn.Module:
    return build_torchvision(num_classes, in_channels, "resnet18", small_input=small_input)
