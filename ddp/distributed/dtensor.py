"""DTensor helpers that work without importing FSDP or DTensor: what a sharded model (ddp/distributed/fsdp.py)
hands the rest of the run. Below both fsdp and process_group, which each need them."""

import sys

import torch
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """`model` is an FSDPModule; without importing FSDP, which only shard_model loads."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a sharded parameter's shard; a reduced value's full value); a plain
    tensor as is. Without importing DTensor, which only a sharded model loads."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor
