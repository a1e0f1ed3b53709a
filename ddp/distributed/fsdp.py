"""strategy=fsdp and hsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) shards each block, then the root.

fsdp: every rank keeps 1/world_size of each parameter, its gradient and its optimizer state; a block's
full parameters exist only while it computes (all-gathered before, freed after its forward when
strategy.reshard_after_forward), and its gradients are reduce-scattered as the backward leaves it.
hsdp: the same within each group of strategy.shard_size ranks (by default a node's processes, so the
all-gathers stay inside a node), each group holding a replica: gradients are reduce-scattered within
the group, then all-reduced across the groups. The optimizer is built afterwards, on the sharded
parameters (DTensors).

precision=bf16|16 is FSDP's MixedPrecisionPolicy, not autocast: the float32 shards stay the master
weights (what the optimizer steps and checkpoints hold), a block's parameters are all-gathered and
computed in the low precision, and gradients are reduced in float32. BatchNorm layers are their own
units that compute in float32 (low-precision batch statistics lose accuracy: torchtitan#674), and the
model's output is float32, so the loss is computed as in precision=32.

FSDP, DTensor and DCP are imported where a model is sharded or a sharded checkpoint is read, not when
train.py starts: they cost every process about 2 CPU-s (sympy among them), and every DataLoader fork
server that preloads train.py as much (ddp/loading/loader_workers.py).
"""

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp.config.schema import SHARDED, ConfigError
from ddp.distributed.process_group import device_mesh, replicas_identical

log = logging.getLogger(__name__)

# The unit of sharding in the families we build: torchvision's ResNet blocks (what layer1-4 hold;
# timm's ResNets use the same names), ViT encoder layers and ConvNeXt blocks (what its stages hold).
# timm's transformers keep theirs in `model.blocks`. A model of ours names its own (fsdp_block_types).
KNOWN_BLOCK_TYPES = ("BasicBlock", "Bottleneck", "EncoderBlock", "CNBlock")


def find_blocks(model: nn.Module, block_types: list[str] | None) -> list[nn.Module]:
    """The modules to shard one by one (outermost first), by class name: `block_types`
    (strategy.block_types) if given, else the `fsdp_block_types` of the model or, behind a task's heads
    (Task.with_heads), of the first module in it that names them (its backbone), else KNOWN_BLOCK_TYPES
    or timm's `blocks` (the model's or its backbone's). An empty list: none, so the root is the one unit
    (shard_model)."""
    names = block_types if block_types is not None else _named_block_types(model)
    blocks = [module for module in model.modules() if type(module).__name__ in names and module is not model]
    if block_types and not blocks:
        present = sorted({type(module).__name__ for module in model.modules()} - {type(model).__name__})
        raise ConfigError(f"strategy.block_types={list(block_types)}: {type(model).__name__} has no module of these "
                          f"classes; pick from {', '.join(present)}, or strategy.block_types=null")
    if block_types is None and not blocks:  # the model's or its backbone's only: a timm ConvNeXt's stages hold `blocks` too
        timm_blocks = (getattr(module, "blocks", None) for module in (model, getattr(model, "backbone", None)))
        blocks = list(next((found for found in timm_blocks if isinstance(found, (nn.Sequential, nn.ModuleList))), []))
    return blocks


def _named_block_types(model: nn.Module) -> tuple[str, ...]:
    """The block classes that the model names (fsdp_block_types), or the first module in it that does: a
    task's heads around a backbone hide the backbone's attribute, not its modules. KNOWN_BLOCK_TYPES if none."""
    named = (getattr(module, "fsdp_block_types", None) for module in model.modules())
    return next((names for names in named if names is not None), KNOWN_BLOCK_TYPES)


def check_blocks(model: nn.Module, strategy_cfg, activation_checkpointing: str) -> None:
    """strategy.block_types names classes the model has (strategy=fsdp or hsdp, or activation_checkpointing), and a
    model to checkpoint has blocks; checked before anything starts."""
    if strategy_cfg.name in SHARDED or activation_checkpointing != "none":
        blocks = find_blocks(model, strategy_cfg.block_types)
        if activation_checkpointing != "none" and not blocks:
            raise ConfigError(f"activation_checkpointing={activation_checkpointing}: no block to checkpoint found in "
                              f"{type(model).__name__} (no fsdp_block_types, no module of {'/'.join(KNOWN_BLOCK_TYPES)}, "
                              "no timm blocks); name its repeated blocks' classes with strategy.block_types=[...], "
                              "or activation_checkpointing=none")


def shard_size(strategy_cfg, local_world_size: int) -> int | None:
    """The ranks of a shard group: strategy.shard_size, by default the processes of a node (hsdp); None for fsdp's 1-D mesh."""
    if strategy_cfg.name != "hsdp":
        return None
    return strategy_cfg.shard_size or local_world_size


LOW_PRECISION = {"bf16": torch.bfloat16, "16": torch.float16}


def shard_model(model: nn.Module, strategy_cfg, device: torch.device, precision: str, local_world_size: int) -> nn.Module:
    """fully_shard each block (innermost first), then the root, over a 1-D mesh of every rank (fsdp) or a 2-D
    mesh of groups of shard_size ranks (hsdp; `local_world_size` is the default shard_size). Returns
    `model` itself, now an FSDPModule whose parameters are DTensor shards. precision=bf16|16: each
    BatchNorm layer first, computing in float32 (module docstring). strategy.block_types=[]: no
    blocks, so the root holds every other parameter as one unit, gathered whole for each forward.

    FSDP doesn't broadcast rank 0's initial weights (pytorch#148756): each rank keeps its slice of its
    own. The same seed builds the same model everywhere; a rank-dependent init is refused here, before
    the shards would silently mix different models."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    name = strategy_cfg.name
    if not replicas_identical(model, include_buffers=True):
        raise RuntimeError(f"strategy={name}: the ranks built different initial weights, and each would keep its slice "
                           "of its own; the model's initialisation must not depend on the rank")
    mesh = device_mesh(device.type, shard_size(strategy_cfg, local_world_size))
    blocks, model_class = find_blocks(model, strategy_cfg.block_types), type(model).__name__  # fully_shard renames the class
    low = LOW_PRECISION.get(precision)
    block_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    shard = {"mesh": mesh, "reshard_after_forward": strategy_cfg.reshard_after_forward}
    if low is not None:  # leaves, so before any block that holds them
        norm_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=low)
        for norm in [module for module in model.modules() if isinstance(module, _BatchNorm) and module not in blocks]:
            fully_shard(norm, mp_policy=norm_policy, **shard)
    for block in reversed(blocks):  # children before the blocks that hold them
        fully_shard(block, mp_policy=block_policy, **shard)
    root_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None,
                                       output_dtype=torch.float32 if low else None)
    fully_shard(model, mp_policy=root_policy, **shard)
    if dist.get_backend() == "gloo":
        # FSDP averages gradients with a ReduceOp.AVG reduce-scatter, which gloo got wrong (it summed:
        # pytorch#162338). Sum instead, the one op every backend does, and let FSDP divide by the world size.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    groups = f"in {mesh.size(0)} replicas, each sharded over {mesh.size(1)} ranks {mesh.mesh.tolist()}" if mesh.ndim == 2 \
        else f"over {mesh.size()} ranks"
    log.info("%s: %d block(s) sharded, then the root, %s (reshard_after_forward=%s, precision=%s)",
             name, len(blocks), groups, strategy_cfg.reshard_after_forward, precision)
    if not blocks and strategy_cfg.block_types is None:  # strategy.block_types=[] asks for this; nothing else should
        log.warning("%s: no block to shard found in %s (no fsdp_block_types, no module of %s, no timm blocks): the whole "
                    "model is one unit, gathered whole on every rank for each forward and backward, the most memory; "
                    "name its repeated blocks' classes with strategy.block_types=[...]", name, model_class,
                    "/".join(KNOWN_BLOCK_TYPES))
    return model
