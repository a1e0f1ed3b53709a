"""Values that every process of one launch agrees on: all its ranks, and their torchrun restarts.

The first process to ask computes the value; the others read it, from torchrun's own store when
torchrun shares it with the workers, else from a claim file under `outputs/.launches/<run id>/` (the tasks
of a submitit job: under its job folder, which they share as they share their logs; `publish` and `wait_for`).
Claim files record the launch's torchrun agents, so the claims of a launch that failed for good can
be pruned once all of its agents have provably ended.
"""

import contextlib
import functools
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from torch.distributed import DistStoreError, TCPStore

OUTPUTS = Path("outputs")
CLAIMS = OUTPUTS / ".launches"  # per launch without torchrun's shared store: what its ranks agreed on
CLAIM_WAIT_S = 60.0  # a claim file still empty after this long: the rank claiming it died


def _error(message: str) -> None:
    """A user-facing stop from inside Hydra's start-up (resolvers, callbacks), where an exception
    would become a traceback: one line, exit 1."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks printing at once keep their lines whole
    sys.exit(1)


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


def provably_gone(record: dict) -> bool:
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
        return _wait_for_claim(path)
    os.close(fd)
    _write_atomically(path, compute())
    return path.read_text()


def publish(key: str, value: str) -> None:
    """For `wait_for`: a value the main process sets for the other processes of its launch."""
    store = _agent_store()
    if store is not None:
        store.set(f"hydra_ddp/{key}", value)
    elif (folder := _shared_folder()) is not None:
        _write_atomically(folder / key, value)


def wait_for(key: str) -> str:
    store = _agent_store()
    if store is not None:
        return store.get(f"hydra_ddp/{key}").decode()
    return _wait_for_claim(_shared_folder() / key)


def wait_at_most(key: str, timeout_s: float) -> str | None:
    """wait_for, but None once `timeout_s` has passed without the value."""
    store = _agent_store()
    if store is None:
        return _read_when_written(_shared_folder() / key, timeout_s)
    try:
        store.wait([f"hydra_ddp/{key}"], timedelta(seconds=timeout_s))
    except DistStoreError:
        return None
    return store.get(f"hydra_ddp/{key}").decode()


def shared_by_the_launch() -> bool:
    """Whether publish and wait_for reach every process of this launch: torchrun's shared store, claim files
    under its run id, or a submitit job's folder (not in a plain process, or under static rendezvous without the
    shared store)."""
    return _agent_store() is not None or _run_id() not in (None, "none") or _job_folder() is not None


def _shared_folder() -> Path | None:
    """Where the launch's processes meet without torchrun's shared store: its claim files under torchrun, else a
    submitit job's folder (None in a plain process)."""
    return _claims_dir() if _run_id() is not None else _job_folder()


def _job_folder() -> Path | None:
    """A submitit task's (not under torchrun): its job's folder, which the job's tasks share as they share their
    logs, with a folder per SLURM attempt (a requeued job runs again under the same job id)."""
    if _run_id() is not None or "SUBMITIT_FOLDER" not in os.environ:
        return None
    from submitit import JobEnvironment  # only in submitit tasks

    return Path(JobEnvironment().paths.folder) / "agreed" / f"attempt{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_for_claim(path: Path) -> str:
    value = _read_when_written(path, CLAIM_WAIT_S)
    if value is None:
        _error(f"{path}: still empty after {CLAIM_WAIT_S:.0f} s (a rank of this launch died while claiming it); relaunch")
    return value


def _read_when_written(path: Path, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and (text := path.read_text()):
            return text
        time.sleep(0.05)
    return None


def release_claims() -> None:
    """The launch is over: its claim files are no longer needed (nothing to do with a shared store)."""
    if _run_id() not in (None, "none") and _agent_store() is None:
        shutil.rmtree(_claims_dir(), ignore_errors=True)
        with contextlib.suppress(OSError):
            CLAIMS.rmdir()  # only if no other launch has claims there
