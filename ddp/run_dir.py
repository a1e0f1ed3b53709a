"""One run dir per launch, and one live run per dir.

Every torchrun worker runs @hydra.main, and `${now:}` is resolved per process, so ranks started a
moment apart would land in different timestamped dirs (hydra#2070); two launches started in the
same second would share one. Here a launch claims a dir nobody has (`mkdir` without exist_ok,
`_1`, `_2`, ... when the name is taken), every rank of the launch gets the claimed name, and a
torchrun restart gets it again. While a run is alive its main process holds a lock on
`<dir>/.lock`, so no second launch writes into it (an explicit hydra.run.dir twice, or
`resume=<dir>` of a run still training).
"""

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed import TCPStore

from ddp.checkpoint import is_sharded_checkpoint
from ddp.config import MULTI_PROCESS
from ddp.env import DistEnv

log = logging.getLogger(__name__)

OUTPUTS = Path("outputs")
CLAIMS = OUTPUTS / ".launches"  # per launch without torchrun's shared store: what its ranks agreed on
TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"
RESTART_LOCK_WAIT_S = 60.0  # a restarted rank 0 waits this long for the previous attempt's lock
MAX_JOB_DIR_NAME = 120
SWEPT_KEYS_ENV = "HYDRA_DDP_SWEPT_KEYS"


def _error(message: str) -> None:
    """A user-facing stop from inside Hydra's start-up (resolvers, callbacks), where an exception
    would become a traceback: one line, exit 1."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks printing at once keep their lines whole
    sys.exit(1)


# --- values a launch agrees on ------------------------------------------------------------------

def _run_id() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID")


@functools.cache
def _agent_store() -> TCPStore | None:
    """torchrun's own store, when it shares it with the workers: it outlives worker restarts."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def _claims_dir() -> Path:
    """The launch's claim files, and before any of them a record of this process's torchrun agent
    (its parent), which lives as long as the launch: restarts included."""
    run_id = _run_id()
    if run_id == "none":
        _error("torchrun gave this launch no id (--rdzv-id defaults to none with --rdzv-endpoint) and "
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 disables its shared store, so the ranks can't agree on a run dir: "
               "pass --rdzv-id=<unique id> to torchrun, or set hydra.run.dir explicitly")
    agent = _process_record(os.getppid())
    _write_atomically(CLAIMS / run_id / "agents" / f"{agent['pid']}@{agent['host']}", json.dumps(agent))
    return CLAIMS / run_id


def _process_record(pid: int) -> dict:
    """What identifies a process across pid reuse and reboots: host, boot, pid and start time."""
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "started": _start_ticks(pid)}


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None  # not Linux: no process can be proven gone


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the fields after the name, which may hold spaces


def _provably_gone(record: dict) -> bool:
    """The process `record` names has ended: it ran on this host, and this host rebooted since, or
    no process with its pid and start time runs now. Unknowable for another host."""
    if record["host"] != socket.gethostname() or record["boot_id"] is None or _boot_id() is None:
        return False
    return record["boot_id"] != _boot_id() or _start_ticks(record["pid"]) != record["started"]


def agreed(key: str, compute: Callable[[], str]) -> str:
    """`compute()` run once per launch, by whichever process asks first; every process of the launch
    (all ranks, and their restarts) gets that value. A process outside torchrun computes its own."""
    if _run_id() is None:
        return compute()
    store = _agent_store()
    if store is not None:
        if store.add(f"hydra_ddp/{key}/claimed", 1) == 1:
            store.set(f"hydra_ddp/{key}", compute())
        return store.get(f"hydra_ddp/{key}").decode()  # waits until the first process has set it
    path = _claims_dir() / key
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return _read_when_written(path)
    os.close(fd)
    _write_atomically(path, compute())
    return path.read_text()


def publish(key: str, value: str) -> None:
    """For `wait_for`: a value the main process sets for the other processes of its launch."""
    store = _agent_store()
    if store is not None:
        store.set(f"hydra_ddp/{key}", value)
    elif _run_id() is not None:
        _write_atomically(_claims_dir() / key, value)


def wait_for(key: str) -> str:
    store = _agent_store()
    if store is not None:
        return store.get(f"hydra_ddp/{key}").decode()
    return _read_when_written(_claims_dir() / key)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_when_written(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and (text := path.read_text()):
            return text
        time.sleep(0.05)
    _error(f"{path}: still empty after {timeout_s:.0f} s (a rank of this launch died while claiming it); relaunch")


def release_claims() -> None:
    """The launch is over: its claim files are no longer needed (nothing to do with a shared store)."""
    if _run_id() not in (None, "none") and _agent_store() is None:
        shutil.rmtree(_claims_dir(), ignore_errors=True)
        with contextlib.suppress(OSError):
            CLAIMS.rmdir()  # only if no other launch has claims there


def _prune_dead_claims() -> None:
    """Claims of launches that failed for good (so never released): those whose torchrun agents have
    all provably ended, unless a live run still holds their dir. Never by age alone: a restart of a
    days-old run, between its old rank 0's death and its new one's lock, still needs its claim."""
    if not CLAIMS.is_dir():
        return
    for claim in CLAIMS.iterdir():
        try:
            agents = [json.loads(p.read_text()) for p in (claim / "agents").iterdir() if not p.name.startswith(".")]
            if not agents or not all(_provably_gone(agent) for agent in agents):
                continue
            dirs = [Path(p.read_text()) for p in claim.iterdir() if p.name in ("run_dir", "sweep_dir")]
            if not any(_holder(d) for d in dirs):
                shutil.rmtree(claim, ignore_errors=True)
        except (OSError, ValueError):
            continue  # being written, or another launch pruned it first


# --- a dir nobody else has ----------------------------------------------------------------------

def claim_unique_dir(parent: Path, name: str) -> Path:
    """`parent/name`, or `name_1`, `name_2`, ... : the first that this call creates (mkdir is atomic)."""
    parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *(f"_{n}" for n in range(1, 10_000))):
        candidate = parent / f"{name}{suffix}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"{parent}: no free name for {name}")


@functools.cache  # Hydra resolves the dir several times; the launch claims it once
def _claimed(key: str, parent: Path) -> str:
    def claim() -> str:
        _prune_dead_claims()
        return str(claim_unique_dir(parent, datetime.now().strftime(TIME_FORMAT)))
    return agreed(key, claim)


def run_dir(resume: str | None, mode: str = "train") -> str:
    """`resume=<run dir>` continues training in that dir; otherwise (and for mode=eval, and from a
    checkpoint: a file, or a sharded one's dir) a new `outputs/<time>` of this launch's own."""
    if mode == "train" and resume and Path(resume).is_dir() and not is_sharded_checkpoint(Path(resume)):
        return resume
    return _claimed("run_dir", OUTPUTS)


def sweep_dir() -> str:
    return _claimed("sweep_dir", OUTPUTS / "multirun")


# --- one live run per dir -----------------------------------------------------------------------

_held_locks: list[int] = []  # open lock files: the locks last as long as this process


def _holder(directory: Path) -> str | None:
    """Who holds `directory`'s lock ("pid ... on host ..., started ..."), or None if nobody does."""
    lock_file = directory / ".lock"
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    except OSError:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # (closing drops this process's own locks on the file: never call this on a dir it holds)


def hold_lock(directory: Path) -> None:
    """Rank 0 locks `directory` for as long as it lives, or stops the launch if a live run holds it.

    A POSIX record lock (fcntl.lockf): the kernel drops it when the process dies, however it dies,
    and unlike flock it is not inherited by forked DataLoader workers, which may outlive a killed rank
    by seconds. The other ranks wait for rank 0's verdict, so a refused launch writes nothing.
    """
    env = DistEnv.from_environ()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    verdict_key = f"lock/{directory.name}/attempt{attempt}"
    if not env.is_main:
        if wait_for(verdict_key) != "ok":
            sys.exit(1)  # rank 0 printed why
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + (RESTART_LOCK_WAIT_S if attempt != "0" else 0)
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                # the line first: once the other ranks read the verdict they exit, and torchrun stops this one
                sys.stderr.write(f"error: {directory} is in use by a live run ({holder}): wait for it to end, or choose "
                                 "another dir (drop hydra.run.dir / resume to get a new one)\n")
                publish(verdict_key, "refused")
                sys.exit(1)
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    started = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode(), 0)
    _held_locks.append(fd)
    publish(verdict_key, "ok")


class RunDirLock(Callback):
    """Takes the lock before Hydra writes anything into the run (or sweep) dir, and lets go of the
    launch's claim files when it ends well."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        hold_lock(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        hold_lock(Path(config.hydra.sweep.dir))
        # For the job dir names; the environment carries them into jobs that run in other processes
        # (submitit's tasks), where sys.argv is not this command's.
        os.environ[SWEPT_KEYS_ENV] = ",".join(sorted(swept_keys(list(config.hydra.overrides.task))))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.RUN and job_return.status == JobStatus.COMPLETED and DistEnv.from_environ().is_main:
            release_claims()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if DistEnv.from_environ().is_main:
            release_claims()


# --- resolvers ----------------------------------------------------------------------------------

def _process_log_name(strategy: str, nproc_per_node: int) -> str:
    """`rank<R>` for a training process; `launcher` for one that will start DDP workers itself."""
    env = DistEnv.from_environ()
    if not env.launched and strategy in MULTI_PROCESS and nproc_per_node > 0:
        return "launcher"
    return f"rank{env.rank}"


def _job_dir_name(job_num: int, task_overrides: list[str]) -> str:
    """`<job number>_<the swept values>` (e.g. `0_data.batch_size=16`): TensorBoard names each run of a
    sweep after its dir, so the scalar legend and the HParams table say which job is which. The swept
    keys are those given several values on the command line; when none are (an Optuna search), the
    name holds all of the job's overrides. A `/` in a value would nest dirs. Names have a length limit:
    overrides that don't fit are left out whole (the sweep summary lists them all); the job number stays."""
    swept = set(filter(None, os.environ.get(SWEPT_KEYS_ENV, "").split(",")))
    chosen = [item for item in task_overrides if item.split("=", 1)[0].lstrip("+~") in swept] or list(task_overrides)
    name = str(job_num)
    for separator, item in zip(["_", *[","] * len(chosen)], sorted(chosen)):
        if len(name) + len(separator) + len(item) > MAX_JOB_DIR_NAME:
            break
        name += separator + item.replace("/", "_")
    return name


def swept_keys(task_overrides: list[str]) -> set[str]:
    """The keys given several values (`data.batch_size=16,32`) among a multirun's command-line overrides."""
    try:
        overrides = OverridesParser.create().parse_overrides(task_overrides)
    except OverrideParseException:
        return set()
    return {override.key_or_group for override in overrides if override.is_sweep_override()}


def register_resolvers() -> None:
    """`${run_dir:RESUME,MODE}` and `${sweep_dir:}` for this launch's dirs; `${rank_zero_only:VALUE}` is
    null on other ranks; `${process_log_name:STRATEGY,NPROC}` names this process's log file, and
    `${process_rank:}` is its rank (torchrun's or SLURM's);
    `${job_dir_name:NUM,TASK_OVERRIDES}` names a sweep job's dir."""
    OmegaConf.register_new_resolver("run_dir", run_dir, replace=True)
    # Cached in the sweep's config, which launchers copy into every job's config (as Hydra does for
    # ${now:}): a job that submitit runs in another process, or a requeued one, gets the same dir.
    OmegaConf.register_new_resolver("sweep_dir", sweep_dir, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("process_log_name", _process_log_name, replace=True)
    OmegaConf.register_new_resolver("process_rank", lambda: DistEnv.from_environ().rank, replace=True)
    OmegaConf.register_new_resolver("job_dir_name", _job_dir_name, replace=True)
    OmegaConf.register_new_resolver(
        "rank_zero_only", lambda value: value if DistEnv.from_environ().is_main else None, replace=True
    )
