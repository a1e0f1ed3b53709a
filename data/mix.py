"""MixUp and CutMix (transforms.v2) of a whole training batch, on the device after collation.

Their random draws (the mixing weight, the box, which of the two) come from torch's global CPU RNG,
seeded per rank: each rank mixes differently, and a checkpoint's RNG state resumes them exactly. This
batch-level randomness is the one part of the data's draws that depends on the world size."""

from collections.abc import Callable

import torch

BatchMix = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def build_batch_mix(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> BatchMix | None:
    """(images, labels) -> (mixed images, soft targets), or None when both alphas are 0."""
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    from torchvision.transforms import v2  # only when mixing: importing torchvision costs every run a second

    mixes = []
    if mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
