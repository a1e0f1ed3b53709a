"""train.py's own main under torchrun, watched from outside the product code. Writes to $WATCH_DIR:

- `syncs_rank<R>.json`: every collective and every tensor-to-host read (`.item()`, `.tolist()`), tagged
  with the number of optimizer steps done when it happened (a global optimizer-step hook counts them);
- `no_sync_rank<R>.txt`: how many times DDP's no_sync() was entered (gradient accumulation);
- `state_rank<R>.pt`: the bare model's state_dict as this rank ends training (taken where train.py
  checks its replicas), and `nudged_rank<R>.txt`: what that check answers for a copy in which rank 1's
  first weight differs by one ulp.
"""

import copy
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path.insert(0, str(TRAIN.parent))
import ddp.process_group  # noqa: E402

WATCH_DIR = Path(os.environ["WATCH_DIR"])
RANK = int(os.environ["RANK"])
steps_done = [0]
events: list[tuple[int, str]] = []


def _count_steps(optimizer, args, kwargs) -> None:
    steps_done[0] += 1


def _recorded(name, function):
    def wrapper(*args, **kwargs):
        events.append((steps_done[0], name))
        return function(*args, **kwargs)
    return wrapper


for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier",
             "reduce", "reduce_scatter", "gather", "scatter", "broadcast_object_list"):
    setattr(dist, name, _recorded(name, getattr(dist, name)))
for name in ("item", "tolist"):
    setattr(torch.Tensor, name, _recorded(name, getattr(torch.Tensor, name)))
register_optimizer_step_post_hook(_count_steps)
no_sync_calls = [0]
real_no_sync = DistributedDataParallel.no_sync


def counted_no_sync(self):
    no_sync_calls[0] += 1
    return real_no_sync(self)


DistributedDataParallel.no_sync = counted_no_sync

real_check = ddp.process_group.replicas_identical


def watched_check(module, include_buffers):
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
ddp.process_group.replicas_identical = watched_check
if __name__ == "__main__":  # not when DataLoader workers' start-up imports this module
    sys.argv[0] = str(TRAIN)
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        (WATCH_DIR / f"syncs_rank{RANK}.json").write_text(json.dumps(events))
        (WATCH_DIR / f"no_sync_rank{RANK}.txt").write_text(str(no_sync_calls[0]))
