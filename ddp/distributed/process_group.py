"""Starting and stopping the process group."""

import contextlib
import functools
import gc
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddp.distributed.dtensor import local_tensor
from ddp.distributed.env import DistEnv

log = logging.getLogger(__name__)


_store: dist.Store | None = None
_groups_started = itertools.count()


def _group_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """A fresh key space in one long-lived rendezvous store, for each process group of this process.

    A sweep under torchrun starts one group per job on the same MASTER_PORT. Re-creating the store
    each time fails when rank 0 hosts it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and reusing keys
    left by an earlier group or attempt hangs. All ranks run the same job sequence, so the counter
    names the same key space on every rank.
    """
    global _store
    if _store is None:
        # torchrun's agent hosts the store unless sharing it is disabled; then rank 0 hosts it.
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        _store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                               is_master=env.rank == 0 and not agent_hosts, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hydra_ddp/attempt{attempt}/group{next(_groups_started)}/", _store)


@contextlib.contextmanager
def process_group(backend: str, env: DistEnv, device: torch.device, timeout_s: float) -> Iterator[None]:
    """Run the body inside an initialised default process group, destroyed at the end."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, or every rank's NCCL context lands on GPU 0
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=_group_store(env, timeout), rank=env.rank, world_size=env.world_size,
                            timeout=timeout, device_id=device if backend == "nccl" else None)  # eager NCCL init
    # nccl's watchdog may abort the process on a timeout before the message below can print.
    log.info("process group up: backend=%s rank=%d world_size=%d device=%s; a collective stuck for "
             "strategy.timeout_s=%g s ends the job", backend, env.rank, env.world_size, device, timeout_s)
    try:
        yield
    except BaseException as error:
        # No barrier here: peers may be inside another collective, and a mismatched one would hang.
        dist.destroy_process_group()
        if isinstance(error, RuntimeError) and "timed out" in str(error).lower():  # DistBackendError too
            raise RuntimeError(
                f"a collective timed out after strategy.timeout_s={timeout_s:g}: a rank stalled or skipped "
                f"a collective ({str(error).strip().splitlines()[0]})"
            ) from error
        raise
    # The barrier keeps a fast rank from tearing down the group while a peer still uses it.
    dist.barrier()
    dist.destroy_process_group()


_meshes: list = []  # the device meshes built over this process's groups (device_mesh)


def device_mesh(device_type: str, shard_size: int | None = None):
    """A 1-D mesh of every rank or, given `shard_size`, a 2-D one ("replicate", "shard") of world_size / shard_size
    groups of shard_size consecutive ranks (torchrun numbers a node's processes consecutively); let go of by
    release_process_groups. Explicit: left to default, a gloo group on a GPU host has segfaulted (pytorch#132471)."""
    from torch.distributed.device_mesh import init_device_mesh  # DTensor's import is costly: only when needed

    world_size = dist.get_world_size()
    if shard_size is None:
        mesh = init_device_mesh(device_type, (world_size,))
    else:
        mesh = init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    _meshes.append(mesh)
    return mesh


def release_process_groups() -> None:
    """Let go of the destroyed process groups that objects still hold, so that each is freed now,
    while Python is alive, rather than at the interpreter's exit.

    destroy_process_group only unregisters a group: its gloo worker threads run until the last
    reference to it goes. A worker thread lets go of its last collective's tensors after the caller
    has moved on; if the interpreter is already exiting by then, taking the GIL ends that thread
    inside a destructor and the rank aborts (`terminate called without an active exception`,
    SIGABRT) after a run that succeeded. Freed here, a group's destructor joins its threads with the
    GIL released, so they finish first. What holds a group: DDP's reducer, SyncBN's modules and FSDP's
    state (garbage once the run's frames are gone, in cycles only the collector frees); a device
    mesh, which DTensor's caches keep for the life of the process. (torch.distributed.nn's functions
    would hold the first default group in their `group=group.WORLD` defaults, were they imported
    after it existed: torchvision imports them at startup.)
    """
    for mesh in _meshes:
        vars(mesh).get("_pg_registry", {}).clear()  # torch 2.14 keeps its groups there, not just their names
    _meshes.clear()
    gc.collect()


def releases_process_groups(rank_main: Callable) -> Callable:
    """`rank_main`, then release_process_groups: for the function that runs a rank."""
    @functools.wraps(rank_main)
    def run_then_release(*args, **kwargs):
        result = rank_main(*args, **kwargs)
        release_process_groups()
        return result
    return run_then_release


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place when a process group exists; a no-op for one process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_per_rank(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, in rank order, on every rank (one all_gather; [values] for one process)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return [local.tolist()]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).tolist()


def on_rank_zero(function: Callable, local: Any, *args) -> Any:
    """`function(every rank's local, *args)` run once, on rank 0, its result (or the exception it raised)
    given to every rank: each returns the result or raises the exception. Without a process group,
    `function([local], *args)`. For work that needs all ranks' objects and must not run on each
    (COCO evaluation); the objects travel pickled (gather_object, broadcast_object_list)."""
    if not (dist.is_available() and dist.is_initialized()):
        return function([local], *args)
    rank_zero = dist.get_rank() == 0
    gathered = [None] * dist.get_world_size() if rank_zero else None
    dist.gather_object(local, gathered, dst=0)
    outcome = [None]
    if rank_zero:
        try:
            outcome = [(True, function(gathered, *args))]
        except Exception as error:  # every rank raises it, rather than waiting for a broadcast that never comes
            outcome = [(False, error)]
    dist.broadcast_object_list(outcome, src=0)
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


def broadcast_buffers_from_rank_zero(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats), the ones its checkpoint holds.

    Without SyncBN, DDP broadcasts rank 0's buffers before each forward, then every rank updates
    them from its own batch: after training each rank holds different statistics, and evaluating
    them would score each shard with a different model.
    """
    if dist.is_available() and dist.is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def replicas_identical(module: torch.nn.Module, include_buffers: bool) -> bool:
    """Whether every rank holds bit-identical parameters (and buffers); True for one process.

    DDP keeps replicas equal only if every rank does the same math; a rank-dependent branch makes
    them drift silently. Checked once at the end of a run. Without SyncBN, compare buffers only
    after `broadcast_buffers_from_rank_zero`: each rank updates them from its own batch. FSDP's
    sharded parameters (DTensors) exist once, not per rank: nothing to compare.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    tensors = module.state_dict().values() if include_buffers else module.parameters()
    tensors = [t for t in tensors if local_tensor(t) is t]  # not a DTensor
    if not tensors:
        return True  # the same on every rank: the same model, sharded
    # Two integers per tensor rather than the model itself: O(tensors) on the wire, and no
    # model-sized allocation on the device at the end of a run.
    digests = torch.stack([_bit_digest(t) for t in tensors])
    highest, lowest = digests.clone(), digests.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return bool(torch.equal(highest, lowest))


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The sums of a tensor's bit patterns (as integers) and of their squares: any change of a bit
    changes them. int64 sums wrap the same way on every rank."""
    bits = tensor.detach().reshape(-1)
    if bits.is_floating_point():
        bits = bits.view(_SAME_SIZE_INT[bits.element_size()])
    bits = bits.to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()])
