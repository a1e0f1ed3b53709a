"""A TorchDispatchMode that records every read of a tensor's value by the host and every copy
between devices: what would make the CPU wait for a GPU.

Wrapping `Tensor.item` misses `bool(t)`, `int(t)`, `float(t)`, `if t:` and torch's own reads from
C++; all of them run `aten._local_scalar_dense`, which this mode sees. `.cpu()`, `.numpy()` of a
device tensor and `.to(device)` run `aten._to_copy` or `aten.copy_` across devices. On a CPU-only
host every tensor is on the CPU, so there the `_local_scalar_dense` count is the signal.

Each event names the innermost Python frame outside torch's dispatch machinery that caused it,
as `<path from site-packages or the repo>:<function>`, so a test can tell torch's GradScaler or
torchvision's CPU-side draws from the project's own code.
"""

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
# frames that only carry a read through to aten, never cause one
TORCH = Path(torch.__file__).parent
PLUMBING = {str(HERE), str(HERE.with_name("instrumented_train.py")),  # the latter wraps Tensor.item
            *(str(TORCH / name) for name in ("utils/_python_dispatch.py", "_tensor.py", "_compile.py",
                                                       "_dynamo/eval_frame.py", "utils/_contextlib.py"))}


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in PLUMBING:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    if "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[1]
    elif path.startswith(str(REPO) + "/"):
        path = path[len(str(REPO)) + 1:]
    return f"{path}:{frame.f_code.co_name}"


def _device_type(value):
    return value.device.type if isinstance(value, torch.Tensor) else None


class HostReads(TorchDispatchMode):
    """`with HostReads(on_event) as reads:` calls on_event(kind, where) for each read or copy, kind
    being `_local_scalar_dense` or `cross_device_copy`; `reads.events` keeps them when no callback
    is given. torch.compile does not compile under a dispatch mode: don't use this around it."""

    def __init__(self, on_event=None):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self.on_event = on_event or (lambda kind, where: self.events.append((kind, where)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.on_event("_local_scalar_dense", _caller())
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type != args[0].device.type:
                self.on_event("cross_device_copy", _caller())
        elif func is torch.ops.aten.copy_.default and _device_type(args[0]) != _device_type(args[1]):
            self.on_event("cross_device_copy", _caller())
        return func(*args, **kwargs)
