"""Segmentation models in torchvision's convention: the forward returns a dict with `out`, logits
N x num_classes x H x W at the input's size, and `aux` where an auxiliary head exists (its loss
counts at 0.5, tasks/segmentation.py). Randomly initialised: nothing is downloaded. model.weights_path
loads local weights into the whole model, or with model.weights_scope=backbone into its `backbone` only
(models/weights.py)."""

import torchvision
from torch import nn
from torch.nn import functional as F

from ddp.config.schema import ConfigError
from models.zoo import adapt_stem

TORCHVISION_NAMES = ("fcn_resnet50", "deeplabv3_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")
NO_AUX_HEAD = ("lraspp_mobilenet_v3_large",)


def build_segmentation_model(num_classes: int, in_channels: int, name: str, aux_loss: bool = True) -> nn.Module:
    """torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=..., aux_loss=...).
    aux_loss adds the auxiliary head of the models that have one (lraspp has none: there it is ignored).
    A stem made for RGB is rebuilt, freshly initialised, for other channel counts."""
    if name not in TORCHVISION_NAMES:
        raise ConfigError(f"model.name={name}: not a segmentation model here; use one of {', '.join(TORCHVISION_NAMES)}")
    kwargs = {} if name in NO_AUX_HEAD else {"aux_loss": aux_loss}
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=num_classes, **kwargs)
    if in_channels != 3:
        adapt_stem(model, name, in_channels)
    return model


def _block(in_channels: int, out_channels: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, stride, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


class SmallSegNet(nn.Module):
    """A few conv + BatchNorm blocks at half resolution, dilated for context: trains on CPU in seconds,
    with enough BatchNorm for SyncBN to matter. `backbone` -> `classifier` gives `out`;
    `aux_classifier` on the backbone's features gives `aux`."""

    fsdp_block_types = ("Conv2d",)  # strategy=fsdp shards each convolution as one unit (ddp/distributed/fsdp.py)

    def __init__(self, num_classes: int, in_channels: int, width: int = 16, aux_loss: bool = True):
        super().__init__()
        self.backbone = nn.Sequential(_block(in_channels, width), _block(width, 2 * width, stride=2))
        self.classifier = nn.Sequential(_block(2 * width, 2 * width, dilation=2), _block(2 * width, 2 * width, dilation=4),
                                        nn.Conv2d(2 * width, num_classes, 1))
        self.aux_classifier = nn.Conv2d(2 * width, num_classes, 1) if aux_loss else None

    def forward(self, x):
        size = x.shape[-2:]
        features = self.backbone(x)
        result = {"out": F.interpolate(self.classifier(features), size=size, mode="bilinear", align_corners=False)}
        if self.aux_classifier is not None:
            result["aux"] = F.interpolate(self.aux_classifier(features), size=size, mode="bilinear", align_corners=False)
        return result


def small_segnet(num_classes: int, in_channels: int, width: int = 16, aux_loss: bool = True) -> SmallSegNet:
    return SmallSegNet(num_classes, in_channels, width, aux_loss)
