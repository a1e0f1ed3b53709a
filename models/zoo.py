"""Any torchvision or timm classification model by name, randomly initialised: nothing is downloaded
(model.weights_path loads local weights, models/weights.py)."""

import difflib

import torchvision
from torch import nn

from ddp.config.schema import ConfigError


def build_torchvision(num_classes: int, in_channels: int, name: str, weights: str | None = None,
                      small_input: bool = False, kwargs: dict | None = None) -> nn.Module:
    """torchvision.models.get_model(name, num_classes=...), with the stem adapted to the data."""
    if weights is not None:
        raise ConfigError(f"model.weights={weights}: nothing is downloaded at run time; download the weights once "
                          "and pass model.weights_path=<file> (model.weights must stay null)")
    check_name(name, torchvision.models.list_models(module=torchvision.models), "torchvision classification model")
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **(kwargs or {}))
    if small_input:
        use_small_input_stem(model, name, in_channels)
    elif in_channels != 3:
        adapt_stem(model, name, in_channels)
    return model


def build_timm(num_classes: int, in_channels: int, name: str, drop_path_rate: float = 0.0,
               kwargs: dict | None = None) -> nn.Module:
    """timm.create_model(name, pretrained=False, ...); timm adapts the stem to in_chans itself."""
    import timm  # imported only when asked for: it takes seconds

    check_name(name, timm.list_models(), "timm model")
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels,
                             drop_path_rate=drop_path_rate, **(kwargs or {}))


def check_name(name: str, names: list[str], kind: str) -> None:
    if name not in names:
        closest = difflib.get_close_matches(name, names, n=3, cutoff=0.0)
        raise ConfigError(f"model.name={name}: no such {kind}; closest: {', '.join(closest)}")


def use_small_input_stem(model: nn.Module, name: str, in_channels: int) -> None:
    """For images of 64 px or less: the ImageNet stem (7x7 stride 2, then max-pool) would shrink
    32 px images to 8 px at once; a 3x3 stride-1 conv without the max-pool keeps them whole."""
    if not (isinstance(getattr(model, "conv1", None), nn.Conv2d) and isinstance(getattr(model, "maxpool", None), nn.Module)):
        raise ConfigError(f"model.small_input=true: applies to ResNet-style models (a conv1 stem, then a max-pool), "
                          f"and {name} has none; set model.small_input=false")
    model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()


def adapt_stem(model: nn.Module, name: str, in_channels: int) -> None:
    """The first convolution, made for RGB, rebuilt for `in_channels` (freshly initialised)."""
    stem_name, stem = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), (None, None))
    if stem is None or stem.in_channels != 3:
        raise ConfigError(f"model.name={name}: can't adapt its stem to {in_channels} input channels; "
                          "use a model with a convolutional stem, or 3-channel data")
    parent_name, _, attribute = stem_name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, nn.Conv2d(
        in_channels, stem.out_channels, stem.kernel_size, stem.stride, stem.padding, stem.dilation, stem.groups,
        bias=stem.bias is not None, padding_mode=stem.padding_mode))
