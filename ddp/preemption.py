"""SIGTERM (preemption, torchrun stopping its workers) and Ctrl-C (SIGINT): finish the step, save,
then exit with 128 + the signal number (143, 130). A second Ctrl-C exits at once. In a job that
submitit started, its requeue signal (USR2, before the time limit and on preemption) also saves,
then hands the job to submitit, which requeues it."""

import contextlib
import logging
import multiprocessing
import os
import shlex
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# torchrun force-kills 30 s after its SIGTERM: leave time to save once at a check step.
STEP_BOUNDARY_GRACE_S = 20.0


class Interrupted(SystemExit):
    """The run stopped at a step boundary because of `signum`, after saving; exits 128 + signum."""

    def __init__(self, signum: int, step: int | None = None):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step

    def __str__(self) -> str:
        where = "" if self.step is None else f" at step {self.step}"
        return f"{'interrupted' if self.signum == signal.SIGINT else f'stopped by {signal.Signals(self.signum).name}'}{where}"


class StopOnSignal:
    """Records SIGTERM and SIGINT instead of dying at once, so the loop can checkpoint at a step
    boundary; a context manager that puts the previous handlers back.

    Under DDP the ranks agree to stop only every `check_every_n_steps` steps and at an epoch's last
    step, where the loop already waits for the device (loss logging, epoch totals): the other steps
    do no collective and no host sync. A rank that doesn't reach a check in time (stalled, or
    blocked in a collective whose peer is gone) exits without a checkpoint rather than holding up
    the shutdown. A second SIGINT means "now": exit at once, without this step's checkpoint.
    """

    def __init__(self, distributed: bool, check_every_n_steps: int, requeue_signal: int | None = None):
        self.distributed = distributed
        self.check_every_n_steps = check_every_n_steps
        self.requeue_signal = requeue_signal
        self.received = 0  # the first stop signal's number
        self.requeue_asked = False
        self.saved_step: int | None = None  # the step whose checkpoint the stop saved
        self.deadline: threading.Timer | None = None

    def __enter__(self) -> "StopOnSignal":
        signums = STOP_SIGNALS if self.requeue_signal is None else (*STOP_SIGNALS, self.requeue_signal)
        self.previous = {signum: signal.signal(signum, self._handle) for signum in signums}
        return self

    def requeue_if_asked(self) -> None:
        """After the stop's checkpoint: let submitit's own handler requeue the job (task 0 asks SLURM,
        or the local executor, and exits; the other tasks return and exit)."""
        handler = self.previous.get(self.requeue_signal)
        if self.requeue_asked and callable(handler):
            handler(self.requeue_signal, None)

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if isinstance(exc, Interrupted):
            return  # on the way out: a second Ctrl-C during shutdown still exits at once, quietly
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        # Runs between two bytecodes of the main thread, maybe inside logging: write, don't log.
        if signum == self.requeue_signal:
            self.requeue_asked = True
        if self.received and signum == signal.SIGINT:
            if self.saved_step is None:
                message = "interrupted again: exiting at once, without a checkpoint of this step (the last saved one is intact)"
            else:
                message = f"interrupted again: exiting at once (the checkpoint of step {self.saved_step} is saved)"
            os.write(2, f"error: {message}\n".encode())
            _exit_now(128 + signal.SIGINT)
        if not self.received:
            self.received = signum
            self.deadline = threading.Timer(STEP_BOUNDARY_GRACE_S, self._give_up)
            self.deadline.daemon = True
            self.deadline.start()

    def _give_up(self) -> None:
        log.error("%s: no step boundary within %.0f s, exiting without a checkpoint",
                  signal.Signals(self.received).name, STEP_BOUNDARY_GRACE_S)
        logging.shutdown()
        _exit_now(128 + self.received)

    def stop_now(self, step: int, epoch_ends: bool, device: torch.device) -> int:
        """The stop signal's number on every rank at the first check after any rank got one (all stop
        at the same step), else 0."""
        stop = self.received
        if self.distributed:
            if step % self.check_every_n_steps and not epoch_ends:
                return 0
            flag = torch.tensor([self.received], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = int(flag.item())
        if stop and self.deadline is not None:
            self.deadline.cancel()  # at the boundary now: the save may take what time is left
        return stop


def submitit_requeue_signal() -> int:
    """The signal with which submitit asks a job to save and requeue: USR2 unless SUBMITIT_PREEMPT_SIGNAL
    names another (SLURM sends it signal_delay_s before the time limit)."""
    from submitit import JobEnvironment

    return getattr(signal, f"SIG{JobEnvironment.USR_SIG}")


def _exit_now(code: int) -> None:
    """Exit without any cleanup, and take this process's children (DataLoader workers) along: left
    alone, a worker would print tracebacks of the connections to it that the exit cuts."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
    os._exit(code)

def resume_command(script: str, overrides: list[str], nproc_per_node: int | None, run_dir: Path) -> str:
    """The command that continues this run where its last checkpoint left it: the same launcher
    (`torchrun --nproc_per_node=N` when `nproc_per_node` is given, else `python`), the same overrides
    and `resume=<run dir>` (relative to the working dir when inside it)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "hydra.run.dir")]
    launcher = ["python"] if nproc_per_node is None else ["torchrun", f"--nproc_per_node={nproc_per_node}"]
    where = os.path.relpath(run_dir) if run_dir.resolve().is_relative_to(Path.cwd().resolve()) else str(run_dir)
    return shlex.join([*launcher, script, *kept, f"resume={where}"])
