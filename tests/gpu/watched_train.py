"""train.py's own main on a GPU, watched from outside the product code (for tests/gpu/gpu_check.py).
Writes `watch_rank<R>.json` to $WATCH_DIR as the process ends:

- `updates`: optimizer steps taken (a global optimizer-step hook counts them; an fp16 step that the
  GradScaler skips is not one, so windows are meant for bf16 or fp32 runs);
- with $SYNC_ERROR_AFTER (comma-separated update numbers): from the optimizer step of each listed
  update to the next optimizer step, `torch.cuda.set_sync_debug_mode("error")` is on, so any host
  sync there (`.item()`, `bool()` of a CUDA tensor, a blocking copy to or from the GPU, a
  synchronize) raises and fails the run. Such a window holds the rest of that update (scheduler,
  EMA, the loop's housekeeping) and the next update's micro-batches up to its optimizer step, as
  the CPU suite's quiet-update watcher counts them. `error_mode_after` lists the windows it armed;
  `probe_raised` says whether error mode really raised, at the first window, for a `.item()` and
  for a blocking CPU-to-GPU copy; `stopped_in_error_mode`, whether the run ended inside a window;
- `no_sync_calls`: how often DDP's no_sync() was entered (gradient accumulation);
- `ddp_wraps`: the type of each module DistributedDataParallel wrapped (OptimizedModule: compiled);
- `dynamo`: torch._dynamo's counters, when torch.compile ran;
- with $WATCH_CONVS set: `convs`, each distinct (device, input channels_last, output dtype) of the
  training-mode Conv2d calls whose input has more than one channel (with one channel both layouts
  are the same).
"""

import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
SYNC_ERROR_AFTER = {int(step) for step in os.environ.get("SYNC_ERROR_AFTER", "").split(",") if step}
report = {"updates": 0, "error_mode_after": [], "probe_raised": None, "no_sync_calls": 0, "ddp_wraps": [], "convs": []}


def error_mode_raises() -> dict[str, bool]:
    """Error mode on; does it refuse the two syncs the quiet updates must not do? (Each raises
    before it syncs, so the probe itself waits for nothing.)"""
    torch.cuda.set_sync_debug_mode("error")
    raised = {}
    for name, sync in (("item", lambda: torch.ones((), device="cuda").item()),
                       ("blocking_copy_to_gpu", lambda: torch.ones(()).to("cuda"))):
        try:
            sync()
            raised[name] = False
        except RuntimeError as error:
            raised[name] = "synchronizing" in str(error)
    return raised


def after_optimizer_step(optimizer, args, kwargs) -> None:
    report["updates"] += 1
    if report["updates"] not in SYNC_ERROR_AFTER:
        if SYNC_ERROR_AFTER:
            report["stopped_in_error_mode"] = torch.cuda.get_sync_debug_mode() == 2
            torch.cuda.set_sync_debug_mode("default")
        return
    if report["probe_raised"] is None:
        report["probe_raised"] = error_mode_raises()
    torch.cuda.set_sync_debug_mode("error")
    report["error_mode_after"].append(report["updates"])


def watch_conv(module, inputs, output) -> None:
    if isinstance(module, nn.Conv2d) and module.training and inputs[0].shape[1] > 1 and not torch.compiler.is_compiling():
        seen = {"device": str(inputs[0].device), "channels_last": inputs[0].is_contiguous(memory_format=torch.channels_last),
                "output_dtype": str(output.dtype).removeprefix("torch.")}
        if seen not in report["convs"]:
            report["convs"].append(seen)


real_no_sync, real_ddp_init = DistributedDataParallel.no_sync, DistributedDataParallel.__init__


def counted_no_sync(self):
    report["no_sync_calls"] += 1
    return real_no_sync(self)


def recorded_ddp_init(self, module, *args, **kwargs):
    report["ddp_wraps"].append(type(module).__name__)
    real_ddp_init(self, module, *args, **kwargs)


if __name__ == "__main__":  # not when DataLoader workers' start-up imports this module
    register_optimizer_step_post_hook(after_optimizer_step)
    DistributedDataParallel.no_sync = counted_no_sync
    DistributedDataParallel.__init__ = recorded_ddp_init
    if os.environ.get("WATCH_CONVS"):
        nn.modules.module.register_module_forward_hook(watch_conv)
    sys.path.insert(0, str(TRAIN.parent))
    sys.argv[0] = str(TRAIN)
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        if SYNC_ERROR_AFTER:
            report["stopped_in_error_mode"] = torch.cuda.get_sync_debug_mode() == 2
            torch.cuda.set_sync_debug_mode("default")
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters
            report["dynamo"] = {group: dict(counts) for group, counts in counters.items()}
        watch_dir = Path(os.environ["WATCH_DIR"])
        (watch_dir / f"watch_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, default=str))
