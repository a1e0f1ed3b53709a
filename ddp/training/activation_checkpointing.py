"""activation_checkpointing=full|selective: the blocks' activations recomputed in the backward instead of kept.

A checkpointed block keeps only its inputs for the backward; the backward runs its forward again, with
the RNG state of the first (dropout draws the same masks), so gradients and weights are bit-identical to
activation_checkpointing=none. The recompute leaves BatchNorm's running statistics as the forward left
them: updated twice, they would drift from an uncheckpointed run's. torch.utils.checkpoint's
non-reentrant implementation: the reentrant one gives a block no gradients, with only a warning, when
its input doesn't require grad.

The blocks are the ones fsdp shards (find_blocks: strategy.block_types, else the model's
fsdp_block_types or the known families'), the outermost of them: a block inside a checkpointed one is
recomputed with it. Applied before torch.compile and before the strategy's wrapper, so under fsdp each
checkpointed block is one sharded unit whose parameters FSDP gathers again for the recompute.
"""

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from ddp.distributed.fsdp import find_blocks

log = logging.getLogger(__name__)


def checkpoint_activations(model: nn.Module, block_types: list[str] | None, mode: str, every: int) -> list[nn.Module]:
    """mode=full: every outermost block of `model` recomputes its activations in the backward;
    selective: every `every`-th of them (the `every`-th, the 2*`every`-th, ...); none: nothing.
    Returns the blocks checkpointed."""
    if mode == "none":
        return []
    blocks = outermost(find_blocks(model, block_types))
    chosen = blocks if mode == "full" else blocks[every - 1::every]
    for block in chosen:
        block.forward = _checkpointed(block)
    log.info("activation_checkpointing=%s: %d of %d blocks (%s) recompute their activations in the backward",
             mode, len(chosen), len(blocks), "/".join(sorted({type(block).__name__ for block in blocks})))
    return chosen


def outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that no other block holds, in order."""
    inner = {id(module) for block in blocks for module in block.modules() if module is not block}
    return [block for block in blocks if id(block) not in inner]


def _checkpointed(block: nn.Module):
    """The block's forward, checkpointed. Eagerly, the recompute puts back the running statistics of the block's
    BatchNorm layers as it found them; compiled, the recompute is traced into the backward without their updates
    (torch.compile takes no other contexts)."""
    forward = block.forward

    def recompute_keeps_statistics() -> tuple:
        return contextlib.nullcontext(), _statistics_kept(block)

    def checkpointed_forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=recompute_keeps_statistics, **kwargs)
    return checkpointed_forward


@contextlib.contextmanager
def _statistics_kept(block: nn.Module):
    buffers = [buffer for module in block.modules() if isinstance(module, _BatchNorm) and module.track_running_stats
               for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)]
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:  # the recompute ends early, by an exception, once it has what the backward needs
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def bytes_saved_for_backward(forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """(the bytes of the tensors that autograd keeps for the backward while `forward()` runs, each storage once, but
    the parameters, which are kept anyway; forward()'s output). With checkpointing, the checkpointed blocks' inputs
    in place of their activations."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    return sum(storages.values()), output
