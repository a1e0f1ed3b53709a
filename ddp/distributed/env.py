"""The process's place in the launch: read from the variables torchrun sets, else from a SLURM (or
local) job that submitit started, else a plain single process; and the process's own settings (its GPUs,
cuDNN's algorithms, how malloc keeps freed memory, the garbage collector)."""

import ctypes
import gc
import logging
import os
from dataclasses import dataclass

import torch

from ddp.config.schema import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = None  # "torchrun" or "submitit"; None for a plain process

    @classmethod
    def from_environ(cls) -> "DistEnv":
        """torchrun first (it also runs inside SLURM jobs: `srun torchrun ...`), then a submitit task
        (hydra/launcher=slurm or submitit_local, one task per GPU), then a plain process."""
        environ = os.environ
        if "RANK" in environ:  # torchrun always sets RANK; never parse a --local_rank argument
            port = environ.get("MASTER_PORT")
            return cls(
                rank=int(environ["RANK"]),
                local_rank=int(environ["LOCAL_RANK"]),
                world_size=int(environ["WORLD_SIZE"]),
                local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
                master_addr=environ.get("MASTER_ADDR"),
                master_port=int(port) if port else None,
                launcher="torchrun",
            )
        if environ.get("SUBMITIT_EXECUTOR") in ("slurm", "local"):
            return cls.from_submitit()
        return cls()

    @classmethod
    def from_submitit(cls) -> "DistEnv":
        """SLURM's task variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list), or the
        local executor's, as submitit reads them: the first host is the master, and the port is
        MASTER_PORT if set, else one derived from the job id, the same in every task."""
        from submitit.helpers import TorchDistributedEnvironment  # only in submitit tasks

        task = TorchDistributedEnvironment()
        return cls(
            rank=task.rank,
            local_rank=task.local_rank,
            world_size=task.world_size,
            local_world_size=task.local_world_size,
            master_addr=task.master_addr,
            master_port=task.master_port,
            launcher="submitit",
        )

    @property
    def launched(self) -> bool:
        """One of a group of processes that a launcher started (torchrun, SLURM through submitit)."""
        return self.launcher is not None

    @property
    def is_main(self) -> bool:
        """This process does the logging, checkpointing and summary writing."""
        return self.rank == 0


def restrict_visible_gpus(devices: list[int] | None) -> None:
    """`devices=[0, 2]`: this process sees only those GPUs, as cuda:0 and cuda:1. CUDA reads
    CUDA_VISIBLE_DEVICES once, when it starts; set later, the variable changes nothing, so it is
    set here, before anything in the run touches CUDA."""
    if devices is None:
        return
    visible = ",".join(str(index) for index in devices)
    if torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != visible:
        raise ConfigError(
            f"devices={list(devices)}: CUDA is already initialised in this process (by an earlier job of this sweep, or "
            "by code that ran before train.py), so its visible GPUs can't change: set CUDA_VISIBLE_DEVICES in the shell instead"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = visible


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """`auto` is nccl on CUDA and gloo otherwise; nccl without GPUs fails here, not inside torch."""
    if backend == "auto":
        return "nccl" if cuda_available else "gloo"
    if backend == "nccl" and not cuda_available:
        raise ConfigError("backend=nccl needs CUDA GPUs and none are visible: use backend=gloo or backend=auto")
    return backend


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


def process_gpus(strategy: str, device: torch.device) -> list[int]:
    """The GPUs this process computes on: every visible one for DataParallel (its default
    device_ids), else the process's own device; none on CPU."""
    if device.type != "cuda":
        return []
    if strategy == "dp":
        return list(range(torch.cuda.device_count()))
    return [device.index]


def set_up_process(deterministic: bool, keep_freed_memory: bool) -> None:
    """This process's own settings, before the data and model take memory: cuDNN's deterministic algorithms only and
    no benchmarking, which may pick others per run (`deterministic`); malloc keeping what the process frees
    (`keep_freed_memory`, keep_freed_host_memory). Here rather than in train.py: submitit pickles train.py's
    functions by value, and the module object torch.backends.cudnn can't be pickled."""
    if deterministic:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if keep_freed_memory:
        keep_freed_host_memory()


def collect_after_imports() -> None:
    """Python's cyclic garbage collector back on, where train.py turned it off for a rank's imports, leaving what they
    made out of its scans (gc.freeze). A rank's imports (torch, Hydra, torchvision where imported) make 300,000 to
    570,000 objects that live as long as the process: the collector scanned them again and again as they came (0.8 s
    of CPU a rank, of 3.7 s), at every full collection of the run (0.2 s each) and at the interpreter's exit (0.7 s).
    Called at the end of the imports, not later: a frozen object is never collected, nor what it refers to, and a
    frame of the run frozen with it (run's own, say, kept by a frame that a caught exception left in a cycle) would
    keep the run's model, process groups and loaders alive past its end. Where the collector is on (a test's
    process), nothing changes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


# glibc's malloc serves an allocation of 128 KiB or more from a fresh mapping, and gives the free memory at the top of
# its heap back to the system once there is more than 128 KiB of it; either way the next allocation takes it again, a
# page fault (and a zeroed page) per 4 KiB. It raises both thresholds as a process frees large blocks, but to 32 MiB and
# 64 MiB at most on 64-bit systems, and a training step frees more than 64 MiB at once: on small_cnn (32 px, batch 32,
# 2 ranks) each rank faulted in about 16,000 pages a step, and a fresh loader worker a batch's images
# (docs/performance.md).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # the largest that mallopt takes on 64-bit systems
MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_host_memory() -> None:
    """glibc's malloc keeps what this process frees for its next allocations, as torch's caching allocator does on
    GPUs: allocations under 32 MiB come from the heap, which keeps up to 2 GiB freed at its top, so a process holds
    its peak. Not where the user set malloc's own variables (MALLOC_TRIM_THRESHOLD_ and the like, or
    GLIBC_TUNABLES), which win, nor with another C library."""
    if any(name in os.environ for name in MALLOC_ENVIRONMENT) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or another C library, with its own malloc
        glibc = None
    if glibc:
        libc = ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
