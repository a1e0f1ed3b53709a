"""The modules a task uses but does not train (Task.frozen_modules: a distillation teacher): on the
device, in eval mode, without gradients; outside DDP/FSDP, the optimizer, the EMA and the checkpoint,
which keeps only a fingerprint of each so that a resume can't silently continue with another one."""

import hashlib
from pathlib import Path

import torch
from torch import nn

from ddp.config.schema import ConfigError


def prepare_frozen(task, device: torch.device) -> None:
    """In place, so the task's own references see it."""
    for module in task.frozen_modules().values():
        module.to(device).eval().requires_grad_(False)


def frozen_fingerprints(task) -> dict[str, str]:
    """{config key: sha256 of the module's state_dict (names, dtypes, shapes and values)}."""
    return {key: fingerprint(module) for key, module in task.frozen_modules().items()}


def fingerprint(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_frozen_fits(task, checkpoint: dict, source: Path) -> None:
    """A resume uses the frozen modules the checkpoint's run trained with: one-line error otherwise."""
    saved, own = checkpoint.get("frozen", {}), frozen_fingerprints(task)
    for key in sorted(saved.keys() | own.keys()):
        if saved.get(key) != own.get(key):
            kind = "has none" if key not in saved else "was trained without it" if key not in own else "used another"
            raise ConfigError(f"{key}: differs from the run this resumes ({source} {kind}); resume with the same "
                              f"{key}, or start a new run (resume=null)")


def check_frozen_unchanged(task, fingerprints: dict[str, str], step: int) -> None:
    """The frozen modules are still those of the run's start (`fingerprints`), as the checkpoint about to be
    saved records: a resume rebuilds them from the config, so one the task changed couldn't be resumed."""
    for key, own in frozen_fingerprints(task).items():
        if own != fingerprints[key]:
            raise ConfigError(f"{key}: the frozen module changed during training (at step {step} it differs from the "
                              f"run's start, which a resume rebuilds from the config); {type(task).__qualname__} must "
                              "not modify it (no .train(), no in-place update)")
