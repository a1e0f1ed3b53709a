"""The process's place in the launch, read from the variables torchrun sets."""

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch


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


def select_device(env: DistEnv) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu; everything moves there with .to(device)."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")
