"""Synchronized BatchNorm that also works on CPU with the gloo backend.

torch's ``nn.SyncBatchNorm`` is CUDA-only: its training forward raises on CPU
tensors and ``DistributedDataParallel`` rejects CPU modules containing it. So
this is a separate ``_BatchNorm`` (deliberately *not* an ``nn.SyncBatchNorm``)
that computes batch statistics over all ranks with plain collectives: one
``all_gather`` in the forward, one ``all_reduce`` in the backward, as torch's
CUDA version does.
"""

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger(__name__)


def _reduce_dims(x):
    return [0, *range(2, x.dim())]  # every dim but the channel dim


def _per_channel(t, x):
    return t.view(1, -1, *([1] * (x.dim() - 2)))  # broadcastable against (N, C, *)


def _global_stats(x, group):
    """Mean, biased variance (float64) and element count per channel over all ranks, in one collective.

    Each rank computes its own count, mean and M2 (sum of squared deviations from its own mean, in two
    passes rather than as E[x^2] - E[x]^2, which cancels badly for large means); all ranks gather them
    and combine them with Chan et al.'s parallel formula, as torch's CUDA SyncBN does
    (batch_norm_gather_stats_with_counts).
    """
    count = x.numel() // x.shape[1]
    local_mean = local_m2 = x.new_zeros(x.shape[1], dtype=torch.float64)  # an empty batch on this rank adds nothing
    if count:
        # torch.var_mean over (N, *) of (N, C, *) is several times slower on CPU than these reductions
        dims, x = _reduce_dims(x), x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 sums in float32
        rounded_mean = x.mean(dims)
        centred = x - _per_channel(rounded_mean, x)
        rounding = centred.mean(dims).double()  # what float32 lost of the mean, measured where it is small
        local_mean = rounded_mean.double() + rounding
        local_m2 = centred.square_().sum(dims).double() - count * rounding.square()
    local = torch.cat([torch.tensor([count], dtype=torch.float64), local_mean, local_m2])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    counts, means, m2s = torch.stack(gathered).split([1, x.shape[1], x.shape[1]], dim=1)
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean).pow(2)).sum(0)
    total = total.item()
    return mean, m2 / total, total


class _SyncBatchNormFn(torch.autograd.Function):
    """Normalisation with given global statistics, by torch's fused BatchNorm kernels; the backward
    adds the gradient through the statistics, which needs two sums over all ranks' batches."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, count, group):
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group, ctx.has_bias = count, group, bias is not None
        return F.batch_norm(x, mean, var, weight, bias, training=False, eps=eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dy = dy.contiguous()
        ones = torch.ones_like(mean) if weight is None else weight
        # this rank's sum(dy) and sum(dy * xhat) per channel, from torch's fused backward kernel
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, ones, None, None, mean, invstd, True, 0.0, [False, True, True])
        dx = None
        if ctx.needs_input_grad[0]:
            # The batch stats depend on every rank's input, so dx needs the global sums:
            # dx = (dy - mean(dy) - xhat * mean(dy * xhat)) * invstd * weight
            sums = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(sums, group=ctx.group)
            g_dy, g_dy_xhat = (s / ctx.count for s in sums.chunk(2))
            scale = invstd * ones
            dx = torch.addcmul(_per_channel(-g_dy * scale, dy), dy, _per_channel(scale, dy))
            dx.addcmul_(x - _per_channel(mean, x), _per_channel(-g_dy_xhat * invstd * scale, x))
        # Parameter grads stay local: DistributedDataParallel averages them across ranks.
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, *) whose training statistics span all ranks of ``process_group``.

    Outside training, or without an initialized multi-rank process group, it is
    exactly ``nn.BatchNorm*d``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None, *, bias=True):
        without_bias = {} if bias else {"bias": False}  # a keyword since torch 2.14 (gpu-check runs older torch)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **without_bias)
        self.process_group = process_group  # None means the default (WORLD) group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1):
            return super().forward(input)

        # Same momentum handling as _BatchNorm.forward (momentum=None: cumulative average).
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        mean, var, count = _global_stats(input.detach(), self.process_group)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count:g}")
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * count / (count - 1)
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        # BatchNorm's kernels take statistics in the parameters' dtype: float32 ones for a bf16 or fp16 input
        # under autocast (precision=bf16), where they normalize in float32 as nn.BatchNorm does
        stats_dtype = self.weight.dtype if self.weight is not None else torch.promote_types(input.dtype, torch.float32)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, mean.to(stats_dtype), var.to(stats_dtype), self.eps,
                                      count, self.process_group)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """Replace every ``BatchNorm*d`` in ``module`` with ``CPUSyncBatchNorm``, sharing its parameters
        and buffers (same structure as ``nn.SyncBatchNorm.convert_sync_batchnorm``)."""
        module_output = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            module_output = cls(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats, process_group,
                                bias=not module.affine or module.bias is not None)
            if module.affine:
                with torch.no_grad():
                    module_output.weight = module.weight
                    module_output.bias = module.bias
            module_output.running_mean = module.running_mean
            module_output.running_var = module.running_var
            module_output.num_batches_tracked = module.num_batches_tracked
            module_output.training = module.training
            if hasattr(module, "qconfig"):
                module_output.qconfig = module.qconfig
        for name, child in module.named_children():
            module_output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return module_output


def convert_syncbn(model: nn.Module, device: torch.device) -> nn.Module:
    """Make ``model``'s BatchNorm layers synchronize across ranks on ``device``.

    CUDA gets torch's fused ``nn.SyncBatchNorm``; everything else gets
    ``CPUSyncBatchNorm``, because torch's version (and DDP with it) refuses CPU modules.
    """
    if torch.device(device).type == "cuda":
        sync_class, group = nn.SyncBatchNorm, None
    else:
        # A group of its own (a collective: every rank converts): gloo runs one group's collectives
        # one at a time, so on DDP's group each backward all_reduce here would queue behind the
        # gradient buckets DDP is reducing meanwhile, and compute would stop overlapping them.
        sync_class = CPUSyncBatchNorm
        group = dist.new_group() if dist.is_available() and dist.is_initialized() else None
    model = sync_class.convert_sync_batchnorm(model, group)
    converted = sum(isinstance(module, sync_class) for module in model.modules())
    log.info("syncbn: %d BatchNorm layers are %s.%s", converted, sync_class.__module__, sync_class.__qualname__)
    return model
