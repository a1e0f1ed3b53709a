"""How a job ends when its run fails or is interrupted: a config error (its run dir put back as it was),
divergence, a full disk or CUDA out of memory (with profiler.memory_history) as one line and exit 1, a
sweep's job failing alone (without the frames that hold its run), a sweep under torchrun stopped at once."""

import logging
import signal
import sys
from pathlib import Path

from hydra.types import RunMode

from ddp.checkpoints.checkpoint import DiskFull, checkpoint_dir
from ddp.config.schema import ConfigError
from ddp.distributed.env import DistEnv
from ddp.jobs.preemption import Interrupted, resume_command
from ddp.jobs.run_dir import undo_refused_launch
from ddp.reporting.profiling import OutOfMemory
from ddp.reporting.sweep_summary import record_failed_job
from ddp.training.update import Diverged

log = logging.getLogger("train")


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
    if isinstance(error, DiskFull):
        error = DiskFull(f"{error}: free some space, then {_how_to_continue(hydra_cfg, env)}")
    if isinstance(error, (ConfigError, Diverged, DiskFull, OutOfMemory)):
        # without the frames that hold it, the run's DataLoader shuts its workers down now, before the line
        drop_traceback(error)
        if isinstance(error, ConfigError):
            undo_refused_launch()  # a refused run leaves its dir as it was (none, if the launch made it)
        if in_sweep and not env.launched:
            return error  # this job fails, the sweep goes on, and its summary says why
        sys.stderr.write(f"error: {error}\n")  # one write: ranks printing at once keep their lines whole
        if in_sweep and env.launcher == "submitit":
            # submitit records the job as failed and the sweep learns why; after an exit it finds no
            # result, and without SLURM accounting (sacct) it would wait for one forever
            return error
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
