"""Object detectors in torchvision's convention (task=detection, tasks/detection.py): in training,
model(images, targets) returns a dict of named losses; in eval mode, model(images) returns one dict
per image with `boxes` (XYXY, in the input image's pixels), `scores` and `labels`. Images are a list of
float tensors in [0, 1] of any size: the detector normalises and resizes them itself (its `transform`,
to model.min_size / model.max_size) and pads the batch.

Any torchvision box detector by model.name, randomly initialised: nothing is downloaded, neither the
detector's weights nor its backbone's, which several builders fetch by default. model.weights_path
loads a local file into the whole model (models/weights.py). Two small detectors made of torchvision's
FCOS and Faster R-CNN around a few conv + BatchNorm blocks train on CPU in seconds."""

import difflib
import inspect
from collections import OrderedDict

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torchvision.models import detection
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.fcos import FCOSHead
from torchvision.ops import FrozenBatchNorm2d, MultiScaleRoIAlign

from ddp.config.schema import ConfigError

# torchvision's box detectors (its mask and keypoint models need targets this repo's data doesn't have),
# by the class whose keyword arguments are their options
TORCHVISION_DETECTORS = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": detection.FasterRCNN,
    "fasterrcnn_mobilenet_v3_large_fpn": detection.FasterRCNN,
    "fasterrcnn_resnet50_fpn": detection.FasterRCNN,
    "fasterrcnn_resnet50_fpn_v2": detection.FasterRCNN,
    "retinanet_resnet50_fpn": detection.RetinaNet,
    "retinanet_resnet50_fpn_v2": detection.RetinaNet,
    "fcos_resnet50_fpn": detection.FCOS,
    "ssd300_vgg16": detection.ssd.SSD,
    "ssdlite320_mobilenet_v3_large": detection.ssd.SSD,
}
SMALL_DETECTORS = {"small_fcos": detection.FCOS, "small_fasterrcnn": detection.FasterRCNN}
DETECTORS = {**TORCHVISION_DETECTORS, **SMALL_DETECTORS}
NOT_OPTIONS = ("self", "backbone", "num_classes", "kwargs")


def build_detection_model(num_classes: int, in_channels: int, name: str, min_size: int | None = None,
                          max_size: int | None = None, frozen_batchnorm: bool = False, kwargs: dict | None = None) -> nn.Module:
    """A detector for `num_classes` classes, the background (label 0) included.

    min_size / max_size: the detector's own resize of each image (null: the model's default, 800 / 1333
    for most). kwargs: any other keyword argument of the detector's class (FasterRCNN, RetinaNet, FCOS,
    SSD: score thresholds, detections per image, sampler sizes, ...), checked against it. frozen_batchnorm:
    the backbone's BatchNorm becomes FrozenBatchNorm2d (statistics and affine fixed), as torchvision
    builds a pretrained backbone: for fine-tuning from model.weights_path. SyncBN leaves it frozen."""
    if name not in DETECTORS:
        closest = difflib.get_close_matches(name, DETECTORS, n=3, cutoff=0.0)
        raise ConfigError(f"model.name={name}: not a detector here; use one of {', '.join(DETECTORS)} (closest: {', '.join(closest)})")
    if in_channels != 3:
        raise ConfigError(f"model.name={name}: detectors take RGB images, and the data has {in_channels} channel(s); use 3-channel data")
    options = dict(kwargs or {})
    for key, value in (("min_size", min_size), ("max_size", max_size)):
        if value is not None:
            options[key] = value
    check_options(name, options)
    if name == "fcos_resnet50_fpn":
        options.setdefault("head", GlobalForegroundFCOSHead(256, 1, num_classes))  # its FPN's channels, one point per location
    if name == "small_fcos":
        model = small_fcos(num_classes, **options)
    elif name == "small_fasterrcnn":
        model = small_fasterrcnn(num_classes, **options)
    else:
        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=num_classes, **options)
    if frozen_batchnorm:
        freeze_batchnorm(model.backbone)
    for module in model.modules():  # Faster R-CNN's RPN and ROI heads
        if isinstance(getattr(module, "fg_bg_sampler", None), BalancedPositiveNegativeSampler):
            sampler = module.fg_bg_sampler
            module.fg_bg_sampler = PerImageSampler(sampler.batch_size_per_image, sampler.positive_fraction)
    return model


class GlobalForegroundFCOSHead(FCOSHead):
    """FCOS's losses divided by the foreground count of the whole global batch, summed over the ranks
    (detectron2 does the same), instead of this rank's: DDP averages the ranks' gradients, so that
    2 ranks x B then train as 1 x 2B does. One all_reduce of a number per training forward, on the device
    (torchvision's own count reads it to the host, once); none without a process group, where the losses
    are torchvision's."""

    def compute_loss(self, targets, head_outputs, anchors, matched_idxs):
        losses = super().compute_loss(targets, head_outputs, anchors, matched_idxs)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return losses
        local = sum((matched >= 0).sum() for matched in matched_idxs).float()  # on the device: no host sync of ours
        total = local.clone()
        dist.all_reduce(total)
        scale = local.clamp(min=1) * dist.get_world_size() / total.clamp(min=1)  # torchvision divided by max(1, local)
        return {name: loss * scale for name, loss in losses.items()}


class PerImageSampler(BalancedPositiveNegativeSampler):
    """The RPN's and ROI heads' positives and negatives, drawn for each image from its own generator when
    `seed_samplers` gave the batch's seeds (task=detection does, from each sample's `seed`), rather than
    from the global RNG, whose draws depend on which images share the rank (torchvision's sampler calls
    torch.randperm). Without seeds it is torchvision's sampler."""

    generators: list[torch.Generator] | None = None

    def __call__(self, matched_idxs):
        if self.generators is None:
            return super().__call__(matched_idxs)
        positives, negatives = [], []
        for matched, generator in zip(matched_idxs, self.generators, strict=True):
            positive = torch.where(matched >= 1)[0]
            negative = torch.where(matched == 0)[0]
            num_pos = min(positive.numel(), int(self.batch_size_per_image * self.positive_fraction))
            num_neg = min(negative.numel(), self.batch_size_per_image - num_pos)
            chosen_pos = positive[torch.randperm(positive.numel(), device=matched.device, generator=generator)[:num_pos]]
            chosen_neg = negative[torch.randperm(negative.numel(), device=matched.device, generator=generator)[:num_neg]]
            positive_mask = torch.zeros_like(matched, dtype=torch.uint8)
            negative_mask = torch.zeros_like(matched, dtype=torch.uint8)
            positive_mask[chosen_pos] = 1
            negative_mask[chosen_neg] = 1
            positives.append(positive_mask)
            negatives.append(negative_mask)
        return positives, negatives


def seed_samplers(model: nn.Module, seeds: list[int] | None, device: torch.device) -> None:
    """Give the model's PerImageSamplers one generator per image of the next forward, seeded by `seeds`
    (the RPN then the ROI heads draw from it, in that order); None: back to the global RNG."""
    samplers = [module.fg_bg_sampler for module in model.modules() if isinstance(getattr(module, "fg_bg_sampler", None), PerImageSampler)]
    if not samplers:  # FCOS, RetinaNet, SSD: nothing samples
        return
    generators = None if seeds is None else [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    for sampler in samplers:
        sampler.generators = generators


def check_options(name: str, options: dict) -> None:
    """Each of model.kwargs a keyword argument of the detector's class: a misspelt one is a one-line error
    here, not a TypeError deep inside torchvision. (The builders' trainable_backbone_layers is not one:
    torchvision applies it only to the weights it downloads, and ignores it otherwise.)"""
    accepted = [key for key in inspect.signature(DETECTORS[name].__init__).parameters if key not in NOT_OPTIONS]
    if name in SMALL_DETECTORS:
        accepted.append("width")
    for key in options:
        if key not in accepted:
            closest = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean model.kwargs.{closest[0]}? " if closest else ""
            raise ConfigError(f"model.kwargs.{key}: not an option of {name} ({DETECTORS[name].__name__}); {hint}"
                              f"options: {', '.join(accepted)}")


def freeze_batchnorm(module: nn.Module) -> None:
    """Every BatchNorm2d under `module` replaced by a FrozenBatchNorm2d holding its statistics and affine."""
    for child_name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            frozen.weight.copy_(child.weight.detach())
            frozen.bias.copy_(child.bias.detach())
            frozen.running_mean.copy_(child.running_mean)
            frozen.running_var.copy_(child.running_var)
            setattr(module, child_name, frozen)
        else:
            freeze_batchnorm(child)


def _block(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


class SmallBackbone(nn.Module):
    """Four conv + BatchNorm blocks down to stride 8, and a second feature map at stride 16: two levels
    for the detection heads, as torchvision's backbones return them (an OrderedDict of feature maps)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(_block(3, width, 2), _block(width, width, 1), _block(width, 2 * width, 2), _block(2 * width, 2 * width, 2))
        self.down = _block(2 * width, 2 * width, 2)
        self.out_channels = 2 * width

    def forward(self, images):
        fine = self.stem(images)
        return OrderedDict([("0", fine), ("1", self.down(fine))])


def small_fcos(num_classes: int, width: int = 16, **options) -> detection.FCOS:
    """torchvision's FCOS on SmallBackbone: one anchor point per location, at strides 8 and 16. Its head's
    GroupNorm takes 32 groups of the 2 x width channels, so width is a multiple of 16."""
    if width <= 0 or width % 16:
        raise ConfigError(f"model.kwargs.width={width}: small_fcos's head normalises 2 x width channels in 32 groups; use a multiple of 16")
    backbone, anchors = SmallBackbone(width), AnchorGenerator(sizes=((16,), (32,)), aspect_ratios=((1.0,), (1.0,)))
    head = GlobalForegroundFCOSHead(backbone.out_channels, 1, num_classes)
    # Box sides start at half the anchor's size, not 0: its regression's ReLU (torchvision's) then starts
    # alive, where from 0 a few large early steps left every box a point, and the mAP at 0, in half our runs
    torch.nn.init.constant_(head.regression_head.bbox_reg.bias, 0.5)
    defaults = {"min_size": 64, "max_size": 128, "score_thresh": 0.05}  # COCO evaluation keeps detections from 0.05, as RetinaNet does
    return detection.FCOS(backbone, num_classes, anchor_generator=anchors, head=head, **(defaults | options))


def small_fasterrcnn(num_classes: int, width: int = 16, **options) -> detection.FasterRCNN:
    """torchvision's Faster R-CNN on SmallBackbone, its RPN and ROI heads sized for small images (fewer
    proposals and sampled boxes than torchvision's defaults, which are for 800 px)."""
    defaults = {"min_size": 64, "max_size": 128, "rpn_pre_nms_top_n_train": 200, "rpn_post_nms_top_n_train": 100,
                "rpn_pre_nms_top_n_test": 100, "rpn_post_nms_top_n_test": 50, "rpn_batch_size_per_image": 64,
                "box_batch_size_per_image": 64}
    backbone, representation = SmallBackbone(width), 64
    anchors = AnchorGenerator(sizes=((8, 16), (32, 48)), aspect_ratios=((0.5, 1.0, 2.0),) * 2)
    return detection.FasterRCNN(backbone, None, rpn_anchor_generator=anchors,
                                box_roi_pool=MultiScaleRoIAlign(["0", "1"], output_size=7, sampling_ratio=2),
                                box_head=TwoMLPHead(backbone.out_channels * 7 * 7, representation),
                                box_predictor=FastRCNNPredictor(representation, num_classes), **(defaults | options))
