"""torchvision's ResNet-18, randomly initialised (no weight download)."""

from torch import nn
from torchvision.models import resnet18


def build_resnet18(num_classes: int, in_channels: int, small_input: bool) -> nn.Module:
    model = resnet18(weights=None, num_classes=num_classes)
    if small_input:
        # The ImageNet stem (7x7 stride 2, then max-pool) would shrink 32 px images to 8 px at once.
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
