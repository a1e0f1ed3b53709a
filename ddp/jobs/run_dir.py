"""One run dir per launch (the lock on a live run's dir: ddp/jobs/dir_lock.py), and the resolvers that
name a run's dirs and log files.

Every torchrun worker runs @hydra.main, and `${now:}` is resolved per process, so ranks started a
moment apart would land in different timestamped dirs (hydra#2070); two launches started in the
same second would share one. Here a launch claims a dir nobody has (`mkdir` without exist_ok,
`_1`, `_2`, ... when the name is taken), every rank of the launch gets the claimed name
(ddp/jobs/launch_agreement.py), and a torchrun restart gets it again.
"""

import contextlib
import functools
import json
import os
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddp.checkpoints.checkpoint import is_sharded_checkpoint
from ddp.config.schema import MULTI_PROCESS
from ddp.distributed.env import DistEnv
from ddp.jobs.dir_lock import hold_lock, lock_holder
from ddp.jobs.launch_agreement import CLAIMS, OUTPUTS, agreed, provably_gone, release_claims

TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"
MAX_JOB_DIR_NAME = 120
SWEPT_KEYS_ENV = "HYDRA_DDP_SWEPT_KEYS"


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


def _prune_dead_claims() -> None:
    """Claims of launches that failed for good (so never released): those whose torchrun agents have
    all provably ended, unless a live run still holds their dir. Never by age alone: a restart of a
    days-old run, between its old rank 0's death and its new one's lock, still needs its claim."""
    if not CLAIMS.is_dir():
        return
    for claim in CLAIMS.iterdir():
        try:
            agents = [json.loads(p.read_text()) for p in (claim / "agents").iterdir() if not p.name.startswith(".")]
            if not agents or not all(provably_gone(agent) for agent in agents):
                continue
            dirs = [Path(p.read_text()) for p in claim.iterdir() if p.name in ("run_dir", "sweep_dir")]
            if not any(lock_holder(d) for d in dirs):
                shutil.rmtree(claim, ignore_errors=True)
        except (OSError, ValueError):
            continue  # being written, or another launch pruned it first


@functools.cache  # Hydra resolves the dir several times; the launch claims it once
def _claimed(key: str, parent: Path) -> str:
    def claim() -> str:
        _prune_dead_claims()
        return str(claim_unique_dir(parent, datetime.now().strftime(TIME_FORMAT)))
    return agreed(key, claim)


def run_dir(resume: str | None, mode: str = "train") -> str:
    """`resume=<run dir>` continues training in that dir; otherwise (and for mode=eval, and from a
    checkpoint: a file, or a sharded one's dir) a new `outputs/<time>` of this launch's own."""
    return resume if _resumes_in_place(resume, mode) else _claimed("run_dir", OUTPUTS)


def _resumes_in_place(resume: str | None, mode: str) -> bool:
    return bool(mode == "train" and resume and Path(resume).is_dir() and not is_sharded_checkpoint(Path(resume)))


def sweep_dir() -> str:
    return _claimed("sweep_dir", OUTPUTS / "multirun")


class RunDirLock(Callback):
    """Takes the lock before Hydra writes anything into the run (or sweep) dir, and lets go of the
    launch's claim files when it ends well."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        directory = Path(config.hydra.run.dir)
        # a new outputs/<time> of this launch's, or a dir that hydra.run.dir names and the launch makes
        claimed = str(config.hydra.run._get_node("dir")._value()).startswith("${run_dir:")
        made = (claimed and not _resumes_in_place(config.get("resume"), config.get("mode", "train"))) or not directory.exists()
        _as_it_was.append(DirSnapshot.of(directory, made))
        hold_lock(directory)

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


# --- a refused launch leaves its run dir as it was ----------------------------------------------------

# What a launch writes into its run dir before its startup checks have run: Hydra's record (written
# before the task function, hydra/core/utils.py run_job), the lock's holder line, and the log files.
RECORD = (".lock", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


@dataclass(frozen=True)
class DirSnapshot:
    """A run dir's RECORD files (bytes, or None: absent), log sizes and top-level names, taken before the
    launch writes anything there; `made`: the launch made the dir."""

    directory: Path
    made: bool
    record: dict[str, bytes | None]
    logs: dict[str, int]
    names: frozenset[str]

    @classmethod
    def of(cls, directory: Path, made: bool) -> "DirSnapshot":
        if made:  # empty before the launch, whatever another rank of it has written by now
            return cls(directory, made, dict.fromkeys(RECORD), {}, frozenset())
        record = {name: (directory / name).read_bytes() if (directory / name).is_file() else None for name in RECORD}
        logs = {path.name: path.stat().st_size for path in directory.glob("*.log")}
        names = frozenset(path.name for path in directory.iterdir()) if directory.is_dir() else frozenset()
        return cls(directory, made, record, logs, names)

    def restore(self, is_main: bool) -> None:
        """Put back what this process may have written: on rank 0, the RECORD files (the lock is rank 0's
        and .hydra/ too); on every rank, the logs (they only grow: cut back, or removed if new). A dir the
        launch made is emptied of them by every rank (torchrun may stop rank 0 before it gets here once
        another rank has failed), and goes. Nothing happens if the launch wrote anything else (it trained)."""
        directory = self.directory
        if not directory.is_dir() or any(name not in (".hydra", ".lock") and not name.endswith(".log")
                                         for name in {path.name for path in directory.iterdir()} - self.names):
            return
        if is_main or self.made:
            for name, content in self.record.items():
                if content is None:
                    (directory / name).unlink(missing_ok=True)
                else:  # (closing this file drops the process's lock on .lock: it is about to exit anyway)
                    (directory / name).write_bytes(content)
            if ".hydra" not in self.names:
                _remove_if_empty(directory / ".hydra")
        for path in directory.glob("*.log"):
            size = self.logs.get(path.name)
            if size is None:
                path.unlink(missing_ok=True)
            elif path.stat().st_size > size:
                os.truncate(path, size)
        if self.made:
            _remove_if_empty(directory)  # under torchrun the last rank to get here removes it


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):
        directory.rmdir()


_as_it_was: list[DirSnapshot] = []  # this process's run dir before the launch (RunDirLock); a single run's only


def undo_refused_launch() -> None:
    """After a startup check refused the run: its run dir as it was before the launch (a resumed run's record,
    lock and logs byte-identical), and a dir the launch made for it removed (docs/run-dirs.md)."""
    while _as_it_was:
        _as_it_was.pop().restore(DistEnv.from_environ().is_main)


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
