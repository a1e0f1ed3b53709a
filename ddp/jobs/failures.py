"""How a job ends when its run fails or is interrupted: a config error (its run dir put back as it was,
and under torchrun one line for a refusal that every rank meets alike), divergence, a full disk or CUDA
out of memory (with profiler.memory_history) as one line and exit 1 (said by rank 0 where the ranks agreed on it), a collective
failed by another rank's end as one line and no error file, a sweep's job failing alone (without
the frames that hold its run), a sweep under torchrun stopped at once; a failing rank's traceback recorded
for torchrun's error summary, whole or not at all."""

import functools
import logging
import os
import signal
import sys
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as torch_record

from ddp.checkpoints.checkpoint import DiskFull, checkpoint_dir
from ddp.config.schema import ConfigError
from ddp.distributed.env import DistEnv
from ddp.jobs.launch_agreement import publish, shared_by_the_launch, wait_at_most
from ddp.jobs.preemption import Interrupted, resume_command
from ddp.jobs.run_dir import undo_refused_launch
from ddp.jobs.sweep_summary import record_failed_job
from ddp.reporting.profiling import OutOfMemory
from ddp.training.update import Diverged

log = logging.getLogger("train")


class WholeErrorFile(ErrorHandler):
    """torch's error handler, its error file (a failing rank's traceback, for torchrun's summary) written
    to a partial file and renamed into place. torch opens the file, emptying it, and then writes it: a rank
    that torchrun stops in between (as it stops the others when one dies) leaves an empty file, and
    torchrun, failing to parse it, ended instead of restarting the job (--max-restarts)."""

    def record_exception(self, e: BaseException) -> None:
        if peer_ended(e):  # not this rank's failure: torchrun's summary names the rank that ended first
            return
        file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # where torchrun reads it (torch's _get_error_file_path)
        if not file:
            return super().record_exception(e)
        os.environ["TORCHELASTIC_ERROR_FILE"] = partial = f"{file}.partial"
        try:
            super().record_exception(e)
        finally:
            os.environ["TORCHELASTIC_ERROR_FILE"] = file
        os.replace(partial, file)


# How gloo's sockets fail when the rank at their other end has ended (its process gone, and its sockets with it)
PEER_ENDED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_ended(error: BaseException) -> str | None:
    """Why a gloo collective failed, where it failed because another rank's process ended; else None."""
    text = str(error)
    if isinstance(error, RuntimeError) and "gloo/transport/tcp" in text:
        return next((reason for reason in PEER_ENDED if reason in text), None)
    return None


# torch's @record: a rank's uncaught exception goes to its error file, and torchrun's summary shows it
record = functools.partial(torch_record, error_handler=WholeErrorFile())

PASSED = "passed"  # a rank's startup outcome when no check refused it
STARTUP_WAIT_S = 300.0  # how long a refused rank waits for the other ranks' startup outcomes


def drop_traceback(error: BaseException) -> BaseException:
    """`error` without the frames its traceback (and those of the exceptions it chains) holds: they
    hold the failed run's model, optimizer, loaders and tensors, and Hydra and the sweepers keep a
    failed job's exception until the sweep ends, while the next jobs run in this process. Clearing
    the frames' locals is not enough: a frame keeps its function, and its function what it closes over."""
    chained, seen = error, set()
    while chained is not None and id(chained) not in seen:  # contexts can form a cycle
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return error


def _how_to_continue(hydra_cfg, env: DistEnv) -> str:
    """The command that resumes the run (as a stop prints it), or a fresh start where it saved nothing yet."""
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if not any(checkpoint_dir(run_dir).glob("step-*")):
        return "run it again (no checkpoint of this run was saved yet)"
    nproc_per_node = env.local_world_size if env.launched else None
    return f"continue with  {resume_command(sys.argv[0], list(hydra_cfg.overrides.task), nproc_per_node, run_dir)}"


def end_failed_job(error: BaseException, hydra_cfg, cfg, env: DistEnv) -> BaseException:
    """Call it in the `except` that caught `error` (the job's run raised it): exits the process, or
    returns the exception for the caller to raise."""
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    if isinstance(error, Interrupted):
        record_failed_job(hydra_cfg, cfg, error)  # a sweep stops here: its summary marks the job
        return drop_traceback(error) if in_sweep else error
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C outside the training loop, where no step boundary comes
        record_failed_job(hydra_cfg, cfg, Interrupted(signal.SIGINT))
        sys.stderr.write("error: interrupted before or after training: exiting; nothing more was saved\n")
        sys.exit(130)
    if getattr(error, "continues_once_fixed", False):  # a full disk freed, a shard server back (data/shard_cache.py)
        error.args = (f"{error}, then {_how_to_continue(hydra_cfg, env)}",)
    if isinstance(error, (ConfigError, Diverged, DiskFull, OutOfMemory)):
        # without the frames that hold it, the run's DataLoader shuts its workers down now, before the line
        drop_traceback(error)
        # a refused run leaves its dir as it was (none, if the launch made it); a failure the ranks agreed on (they
        # raise it together) is said by rank 0 alone, one that some ranks found by each of them (an out-of-memory
        # names the rank and its snapshot)
        if isinstance(error, ConfigError):
            says_it = end_refused_launch(str(error), Path(hydra_cfg.runtime.output_dir), env)
        else:
            says_it = env.rank == 0 or not getattr(error, "on_every_rank", False)
        if says_it:
            sys.stderr.write(f"error: {error}\n")  # one write: ranks printing at once keep their lines whole
        if in_sweep and not env.launched:
            return error  # this job fails, the sweep goes on, and its summary says why (SweepSummary)
        if in_sweep and env.launcher == "submitit":
            # submitit records the job as failed and the sweep learns why; after an exit it finds no
            # result, and without SLURM accounting (sacct) it would wait for one forever
            return error
        sys.exit(1)
    if env.launched and (reason := peer_ended(error)):  # the rank that ended says why (torchrun's summary: its root cause)
        record_failed_job(hydra_cfg, cfg, error)
        sys.stderr.write(f"error: rank {env.rank}: another rank ended during a collective, so this one stops too "
                         f"(gloo: {reason}); that rank's own error, or its exit code, says why\n")
        sys.exit(1)
    if isinstance(error, Exception) and in_sweep:
        if env.launched:
            # Hydra would raise only after the whole batch of jobs, leaving the other ranks waiting in
            # collectives of the next job: end the sweep now (torchrun then stops the other ranks).
            log.exception("sweep job %d (%s) failed; stopping the sweep", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task))
            record_failed_job(hydra_cfg, cfg, error)
            sys.exit(1)
        # the traceback goes to this job's log; the sweep goes on without the job's frames
        log.exception("sweep job %d (%s) failed", hydra_cfg.job.num, " ".join(hydra_cfg.overrides.task))
        return drop_traceback(error)
    return error


# --- a refused launch under torchrun or submitit: one line, one rank undoes it ------------------------

def _startup_outcome_key(run_dir: Path, rank: int) -> str:
    return f"startup/{run_dir.name}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank{rank}"


def _compares_startup_outcomes(env: DistEnv) -> bool:
    """torchrun's ranks and a submitit job's tasks that run Hydra's job (self-launched workers hand a refusal to their
    launcher, which prints it)."""
    return env.launcher in ("torchrun", "submitit") and HydraConfig.initialized() and shared_by_the_launch()


def startup_passed(run_dir: Path) -> None:
    """This rank's startup checks are all behind it (its process group comes next): a rank they refused
    then prints its own line, and may undo the run dir (end_refused_launch)."""
    env = DistEnv.from_environ()
    if _compares_startup_outcomes(env):
        publish(_startup_outcome_key(run_dir, env.rank), PASSED)


def end_refused_launch(line: str, run_dir: Path, env: DistEnv) -> bool:
    """A startup check refused the run (ConfigError `line`): puts its run dir back as it was (undo_refused_launch)
    and returns whether this process prints the line.

    Under torchrun every rank runs the checks and posts its outcome (torchrun's store or claim files, no process
    group). A refused rank waits for every rank's: it prints its line unless a lower rank was refused with the
    same one (a check every rank meets alike prints once; one that a single node meets, its data missing, still
    prints there), and the lowest refused rank alone undoes the run dir, once no rank still writes Hydra's record
    or its log there. A rank that posts nothing in STARTUP_WAIT_S leaves each refused rank to print and undo."""
    if not _compares_startup_outcomes(env):
        undo_refused_launch()
        return True
    refused = f"refused: {line}"
    publish(_startup_outcome_key(run_dir, env.rank), refused)
    deadline = time.monotonic() + STARTUP_WAIT_S
    outcomes = [wait_at_most(_startup_outcome_key(run_dir, rank), max(deadline - time.monotonic(), 0.01))
                for rank in range(env.world_size)]
    if None in outcomes:
        undo_refused_launch()
        return True
    if [outcome != PASSED for outcome in outcomes].index(True) == env.rank:
        undo_refused_launch()
    return outcomes.index(refused) == env.rank
