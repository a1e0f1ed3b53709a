"""Preparing the model for training and wrapping it for the chosen strategy, and unwrapping it for
saving and evaluation."""

import logging
import random

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp.config.schema import SHARDED
from ddp.distributed.env import DistEnv
from ddp.distributed.fsdp import find_blocks, shard_model
from ddp.distributed.syncbn import convert_syncbn
from ddp.run_context import RunContext
from ddp.training.activation_checkpointing import checkpoint_activations, outermost
from ddp.training.ema import EMA, build_ema

log = logging.getLogger(__name__)


def prepare_model(model: nn.Module, ctx: RunContext) -> tuple[nn.Module, nn.Module, nn.Module, EMA | None]:
    """(the model that trains, wrapped; the bare model that checkpoints hold; the module compiled, or
    not; its EMA or None), in this order: device and memory format (channels_last), SyncBN (syncbn,
    strategy=ddp, fsdp or hsdp), the EMA's copy (ema.decay), the blocks' activation checkpointing
    (activation_checkpointing), torch.compile (compile, compile_mode), the strategy's wrapper (in
    precision). Under fsdp and hsdp all three models are one, sharded in place."""
    cfg, device = ctx.cfg, ctx.device
    model = model.to(device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    if cfg.syncbn and ctx.distributed:
        model = convert_syncbn(model, device)
    raw_model, ema = model, build_ema(model, cfg.ema.decay)
    checkpoint_activations(model, cfg.strategy.block_types, cfg.activation_checkpointing, cfg.activation_checkpointing_every)
    # Compiled before wrapping, as timm does (the two orders measured alike on CPU: docs/recipes.md); under fsdp and
    # hsdp each block, in place. Checkpoints hold raw_model's plain keys, never torch.compile's `_orig_mod.` ones.
    sharded = cfg.strategy.name in SHARDED
    trained = torch.compile(model, mode=cfg.compile_mode) if cfg.compile and not sharded else model
    if cfg.compile and sharded:
        compile_blocks(model, cfg.strategy.block_types, cfg.compile_mode)
    return wrap_model(trained, cfg.strategy, ctx.env, device, cfg.precision), raw_model, trained, ema


def compile_blocks(model: nn.Module, block_types: list[str] | None, mode: str | None) -> None:
    """fsdp and hsdp compile each block, the unit FSDP shards, as torchtitan does: its forward (checkpointed or not), so
    that FSDP's hooks around it, which gather and free its parameters, run eagerly, and its keys stay the plain ones."""
    blocks = outermost(find_blocks(model, block_types))
    for block in blocks:
        block.forward = torch.compile(block.forward, mode=mode)
    log.info("compile=true: %d blocks compiled, each where FSDP shards it", len(blocks))


def wrap_model(model: nn.Module, strategy_cfg, env: DistEnv, device: torch.device, precision: str) -> nn.Module:
    """single: the model itself; dp: nn.DataParallel over the visible GPUs; ddp: DistributedDataParallel;
    fsdp, hsdp: the model itself, sharded, in `precision` (ddp/distributed/fsdp.py; the others autocast in ddp/training/update.py)."""
    name = strategy_cfg.name
    if name == "single":
        return model
    if name in SHARDED:
        return shard_model(model, strategy_cfg, device, precision, env.local_world_size)
    if name == "dp":
        if device.type != "cuda":
            log.warning("strategy=dp: no CUDA GPUs visible, so DataParallel runs one replica on CPU")
        return nn.DataParallel(model)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=strategy_cfg.bucket_cap_mb,
        find_unused_parameters=strategy_cfg.find_unused_parameters,
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model, whose state_dict has no `module.` prefix and loads into any strategy."""
    if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        return model.module
    return model


def seed_this_rank(model: nn.Module, seed: int) -> None:
    """Per-rank randomness (dropout, augmentation in the main process) from here on: torch's and
    Python's RNGs get `seed`, the rank's own. torch.manual_seed gives every GPU the same seed, so
    DataParallel's replicas would draw the same dropout masks for their chunks of the batch; give each
    replica's device its own stream."""
    torch.manual_seed(seed)
    random.seed(seed)
    if isinstance(model, nn.DataParallel):
        for index in model.device_ids[1:]:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed + 1_000_003 * index)
