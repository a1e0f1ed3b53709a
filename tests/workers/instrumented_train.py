"""train.py's own main under torchrun, watched from outside the product code. Writes to $WATCH_DIR:

- `syncs_rank<R>.json`: every collective (FSDP's gradient reduce-scatters, `reduce_scatter_single`,
  too) and every tensor-to-host read (`.item()`, `.tolist()`), tagged with the number of optimizer
  steps done when it happened (a global optimizer-step hook counts them); `reduce_scatter_ops_rank<R>.json`:
  the reduction op of each reduce-scatter (SUM, AVG, ...);
- `host_reads_rank<R>.json`: [steps done, kind, where] for every host read of a tensor's value however
  it is made (`bool()`, `int()`, `float()` and torch's own reads too) and every copy between devices,
  seen by workers/host_reads.py's dispatch mode;
- `convs_rank<R>.json`: each distinct [input is channels_last, output dtype] of a convolution in
  training mode; `applied_grad_norms_rank<R>.json`: the gradients' total norm as each optimizer step
  applies them;
- `dynamo_rank<R>.json`: torch._dynamo's counters (`stats`, `frames`) as the run ends;
- `no_sync_rank<R>.txt`: how many times DDP's no_sync() was entered (gradient accumulation);
- `state_rank<R>.pt`: the bare model's state_dict as this rank ends training (taken where train.py
  checks its replicas; not for a sharded model), and `nudged_rank<R>.txt`: what that check answers for a copy in which rank 1's
  first weight differs by one ulp.

WATCH_TENSORS=0 leaves out the dispatch mode and the convolution hooks: torch.compile compiles
nothing under a dispatch mode, so a compiled run needs it.
"""

import contextlib
import copy
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path.insert(0, str(TRAIN.parent))
import ddp.distributed.dtensor  # noqa: E402
import ddp.distributed.process_group  # noqa: E402
from host_reads import HostReads  # noqa: E402  (this script's own folder)

WATCH_DIR = Path(os.environ["WATCH_DIR"])
RANK = int(os.environ["RANK"])
WATCH_TENSORS = os.environ.get("WATCH_TENSORS", "1") == "1"
steps_done = [0]
events: list[tuple[int, str]] = []
reduce_scatter_ops: list[str] = []
host_reads: list[tuple[int, str, str]] = []
convs: set[tuple[bool, str]] = set()
applied_grad_norms: list[torch.Tensor] = []  # read only after the run, so the watcher adds no host read


def _count_steps(optimizer, args, kwargs) -> None:
    steps_done[0] += 1


def _recorded(name, function):
    def wrapper(*args, **kwargs):
        events.append((steps_done[0], name))
        if name == "reduce_scatter_single":
            reduce_scatter_ops.append(str(kwargs.get("op", dist.ReduceOp.SUM)))
        return function(*args, **kwargs)
    return wrapper


for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier",
             "reduce", "reduce_scatter", "gather", "scatter", "broadcast_object_list", "reduce_scatter_single"):
    setattr(dist, name, _recorded(name, getattr(dist, name)))
for name in ("item", "tolist"):
    setattr(torch.Tensor, name, _recorded(name, getattr(torch.Tensor, name)))
register_optimizer_step_post_hook(_count_steps)


def _record_applied_grad_norm(optimizer, args, kwargs) -> None:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    applied_grad_norms.append(ddp.distributed.dtensor.local_tensor(nn.utils.get_total_norm(grads)).detach())  # a DTensor's under fsdp


def _record_conv(module, inputs, output) -> None:
    if isinstance(module, nn.Conv2d) and module.training:
        convs.add((inputs[0].is_contiguous(memory_format=torch.channels_last) and not inputs[0].is_contiguous(),
                   str(output.dtype)))


register_optimizer_step_pre_hook(_record_applied_grad_norm)
if WATCH_TENSORS:
    nn.modules.module.register_module_forward_hook(_record_conv)
no_sync_calls = [0]
real_no_sync = DistributedDataParallel.no_sync


def counted_no_sync(self):
    no_sync_calls[0] += 1
    return real_no_sync(self)


DistributedDataParallel.no_sync = counted_no_sync

real_check = ddp.distributed.process_group.replicas_identical


def watched_check(module, include_buffers):
    if ddp.distributed.dtensor.is_sharded(module):  # one sharded model, not replicas (and FSDP refuses deepcopy)
        return real_check(module, include_buffers)
    torch.save(module.state_dict(), WATCH_DIR / f"state_rank{RANK}.pt")
    nudged = copy.deepcopy(module)
    if RANK == 1:
        with torch.no_grad():
            weight = next(nudged.parameters())
            first = (0,) * weight.dim()
            weight[first] = torch.nextafter(weight[first], torch.tensor(float("inf")))
    (WATCH_DIR / f"nudged_rank{RANK}.txt").write_text(str(real_check(nudged, include_buffers)))
    return real_check(module, include_buffers)


# train.py imports the check by name when it runs, so it gets the watched one.
ddp.distributed.process_group.replicas_identical = watched_check
if __name__ == "__main__":  # not when DataLoader workers' start-up imports this module
    sys.argv[0] = str(TRAIN)
    watching = HostReads(lambda kind, where: host_reads.append((steps_done[0], kind, where)))
    try:
        with watching if WATCH_TENSORS else contextlib.nullcontext():
            runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        from torch._dynamo.utils import counters

        (WATCH_DIR / f"syncs_rank{RANK}.json").write_text(json.dumps(events))
        (WATCH_DIR / f"reduce_scatter_ops_rank{RANK}.json").write_text(json.dumps(reduce_scatter_ops))
        (WATCH_DIR / f"host_reads_rank{RANK}.json").write_text(json.dumps(host_reads))
        (WATCH_DIR / f"no_sync_rank{RANK}.txt").write_text(str(no_sync_calls[0]))
        (WATCH_DIR / f"convs_rank{RANK}.json").write_text(json.dumps(sorted(convs)))
        norms = torch.stack(applied_grad_norms).tolist() if applied_grad_norms else []
        (WATCH_DIR / f"applied_grad_norms_rank{RANK}.json").write_text(json.dumps(norms))
        (WATCH_DIR / f"dynamo_rank{RANK}.json").write_text(
            json.dumps({group: dict(counters[group]) for group in ("stats", "frames")}))
