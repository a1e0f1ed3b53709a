"""Self-launched DDP: `python train.py strategy=ddp strategy.nproc_per_node=N` starts its own worker
group through PyTorch's elastic launcher (the engine behind torchrun), one group per Hydra job."""

import logging
import multiprocessing
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddp.checkpoints.checkpoint import DiskFull
from ddp.config.schema import ConfigError
from ddp.jobs.preemption import Interrupted
from ddp.reporting.profiling import OutOfMemory
from ddp.training.update import Diverged

log = logging.getLogger(__name__)

# The errors that end a run in one line (ddp/jobs/failures.py). Every rank raises them alike (the startup
# checks are the same on each; divergence and a failed save are decided together), so a worker returns
# one as its result and the launcher raises it again: a failed worker would print the agent's
# tracebacks (one a rank) and torch's error summary, and be restarted under strategy.max_restarts.
ONE_LINE_ERRORS = (ConfigError, Diverged, DiskFull, OutOfMemory)
ONE_LINE_ERROR = "one_line_error"
# The same line format as hydra.job_logging in conf/config.yaml: spawned workers have no Hydra logging.
LOG_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] %(message)s"


def launch_workers(run: Callable, cfg: DictConfig, run_dir: Path, relaunch: str, job_name: str, nproc: int,
                   max_restarts: int) -> dict[str, Any]:
    """Run `run(cfg, run_dir, relaunch)` on `nproc` local worker processes and return rank 0's result."""
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hydra-ddp-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",  # elastic_launch defaults to etcd
        rdzv_endpoint="localhost:0",  # a free port for every job of a sweep
        max_restarts=max_restarts,  # elastic_launch defaults to 3, torchrun to 0
        start_method="spawn",
        monitor_interval=0.5,
    )
    # torchrun sets this too: N processes each using every core would oversubscribe the CPU.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log.info("starting %d DDP workers (run id %s)", nproc, launch_config.run_id)
    # The config crosses the process boundary as a plain, resolved container; the workers all get
    # the same values (a sweeper's samples included) and the same run dir.
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        returns = elastic_launch(launch_config, _worker)(run, container, str(run_dir), relaunch, job_name)
    except SignalException as stop:
        # The agent passed the signal (Ctrl-C, SIGTERM) on to the workers once and waited while they
        # saved and exited. A second Ctrl-C during that wait lands here too: pass it on, so that they
        # exit at once.
        for worker in multiprocessing.active_children():
            os.kill(worker.pid, stop.sigval)
        raise Interrupted(stop.sigval) from None
    if ONE_LINE_ERROR in returns[0]:
        raise returns[0][ONE_LINE_ERROR]  # pickled without its traceback: only the message crosses
    return returns[0]


def _worker(run: Callable, container: dict, run_dir: str, relaunch: str, job_name: str) -> dict[str, Any]:
    # Out of the launcher's process group: a Ctrl-C in the terminal reaches the launcher alone,
    # which passes it on once (a worker hit twice would exit without saving).
    os.setpgid(0, 0)
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO,
        format=LOG_FORMAT.format(rank=rank),
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(Path(run_dir) / f"{job_name}_rank{rank}.log")],
        force=True,
    )
    try:
        return run(OmegaConf.create(container), Path(run_dir), relaunch)
    except ONE_LINE_ERRORS as error:
        return {ONE_LINE_ERROR: error}
