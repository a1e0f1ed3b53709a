"""What every stage of one run reads: resolved once by train.py's `run`, frozen, and passed
explicitly (never a global), so a stage's signature names what it uses besides it."""

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from ddp.config.schema import MULTI_PROCESS
from ddp.distributed.env import DistEnv


@dataclass(frozen=True)
class RunContext:
    cfg: DictConfig  # the composed config, as validated at startup
    env: DistEnv  # this process's place in the launch
    backend: str  # the process group's, resolved (gloo, nccl, ...)
    device: torch.device  # this rank's
    gpus: list[int]  # the GPUs it computes on: every visible one for DataParallel, else its own; none on CPU
    run_dir: Path
    relaunch: str  # the command that continues the run after an interruption
    memory_reset: bool  # the peak memory was reset at startup (False: the RSS peak is the process's, not Linux)

    @property
    def distributed(self) -> bool:
        """One process per device, in a process group (strategy=ddp or fsdp)."""
        return self.cfg.strategy.name in MULTI_PROCESS

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"
