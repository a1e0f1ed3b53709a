"""The process's place in the launch, read from the variables torchrun sets."""

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddp.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    under_torchrun: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "DistEnv":
        # torchrun always sets RANK; never parse a --local_rank argument.
        if "RANK" not in environ:
            return cls()
        port = environ.get("MASTER_PORT")
        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ["LOCAL_RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
            master_addr=environ.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            under_torchrun=True,
        )

    @property
    def is_main(self) -> bool:
        """This process does the logging, checkpointing and summary writing."""
        return self.rank == 0


def select_device(env: DistEnv, backend: str | None, visible_gpus: int) -> torch.device:
    """The device this process trains on; everything moves there with .to(device).

    `visible_gpus` is torch.cuda.device_count(): the GPUs that CUDA_VISIBLE_DEVICES leaves visible.
    One visible GPU is cuda:0 whatever LOCAL_RANK is (one GPU per process: SLURM
    --gpus-per-task=1, Kubernetes). More processes than GPUs work only over gloo, which lets ranks
    share a GPU; nccl refuses two ranks on one GPU.
    """
    if visible_gpus == 0:
        return torch.device("cpu")
    if env.local_rank < visible_gpus:
        return torch.device("cuda", env.local_rank)
    if visible_gpus > 1 and backend == "nccl":
        raise ConfigError(
            f"LOCAL_RANK={env.local_rank} but only {visible_gpus} GPUs are visible, and backend=nccl needs one GPU per "
            f"process: start at most {visible_gpus} processes per node (torchrun --nproc_per_node={visible_gpus}), "
            "or use backend=gloo to share GPUs"
        )
    index = env.local_rank % visible_gpus
    if backend == "gloo":
        log.warning("LOCAL_RANK=%d with %d visible GPU(s): this rank uses cuda:%d, shared with other ranks "
                    "of this node unless each process sees its own GPU", env.local_rank, visible_gpus, index)
    return torch.device("cuda", index)
