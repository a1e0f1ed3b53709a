"""One live run per dir: while a run is alive its main process holds a lock on `<dir>/.lock`, so no
second launch writes into it (an explicit hydra.run.dir twice, or `resume=<dir>` of a run still
training)."""

import fcntl
import os
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from ddp.distributed.env import DistEnv
from ddp.jobs.launch_agreement import publish, wait_for

RESTART_LOCK_WAIT_S = 60.0  # a restarted rank 0 waits this long for the previous attempt's lock

_held_locks: list[int] = []  # open lock files: the locks last as long as this process


def lock_holder(directory: Path) -> str | None:
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
