"""SIGTERM (preemption, torchrun stopping its workers) and Ctrl-C (SIGINT): finish the step, save,
then exit with 128 + the signal number (143, 130). A second Ctrl-C exits at once. In a job that
submitit started, its requeue signal (USR2, before the time limit and on preemption) also saves,
then hands the job to submitit, which requeues it. The console's line names the command that
continues the run."""

import contextlib
import logging
import multiprocessing
import os
import select
import shlex
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddp.distributed.env import DistEnv
from ddp.loading.loader_workers import shut_down_workers

log = logging.getLogger(__name__)
console = logging.getLogger("train")  # the run's own console lines, under the script's name

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    boundary (`stop_requested`, then `stopped`); a context manager that puts the previous handlers back.

    Under DDP the ranks agree to stop only every `check_every_n_steps` steps and at an epoch's last
    step, where the loop already waits for the device (loss logging, epoch totals): the other steps
    do no collective and no host sync. A rank that doesn't reach a check within `deadline_s` of its
    first stop signal (stalled, in a long validation or save, or blocked in a collective whose peer
    is gone) exits without a checkpoint rather than holding up the shutdown; after submitit's
    requeue signal it still has submitit requeue the job, which resumes from its last checkpoint. A
    second SIGINT means "now": exit at once, without this step's checkpoint.

    Python runs a signal handler only when the main thread returns to bytecode, which a rank
    blocked in a collective doesn't do until the collective returns. So the deadline and the second
    SIGINT are enforced by a watchdog thread that learns of each signal from the interpreter's
    wakeup fd (`signal.set_wakeup_fd`), written the moment the signal arrives; it needs only that
    the blocked call release the GIL, as collectives, device waits and sleeps do.
    """

    def __init__(self, distributed: bool, check_every_n_steps: int, deadline_s: float, requeue_signal: int | None = None, *,
                 device: torch.device = torch.device("cpu"), relaunch: str = "", is_main: bool = True):
        self.distributed, self.device = distributed, device  # the agreement's tensor lives on the device
        self.relaunch, self.is_main = relaunch, is_main  # the console's hint after a stop: the command that continues
        self.check_every_n_steps = check_every_n_steps
        self.requeue_signal = requeue_signal
        self.deadline_s = deadline_s
        self.received = 0  # the first stop signal's number
        self.requeue_asked = False
        self.saved_step: int | None = None  # the step whose checkpoint the stop saved
        # Held by the watchdog from the moment it gives up: the loop then can't start a stop's save.
        self._at_boundary_lock = threading.Lock()
        self._at_boundary = False

    @classmethod
    def of(cls, trainer_cfg, env: DistEnv, device: torch.device, relaunch: str) -> "StopOnSignal":
        """The training loop's: ranks agree at log steps (trainer.log_every_n_steps), a stalled rank
        gives up after trainer.stop_deadline_s, and in a job that submitit started its requeue signal stops too."""
        return cls(distributed=dist.is_initialized(), check_every_n_steps=trainer_cfg.log_every_n_steps,
                   deadline_s=trainer_cfg.stop_deadline_s,
                   requeue_signal=submitit_requeue_signal() if env.launcher == "submitit" else None,
                   device=device, relaunch=relaunch, is_main=env.is_main)

    def __enter__(self) -> "StopOnSignal":
        signums = STOP_SIGNALS if self.requeue_signal is None else (*STOP_SIGNALS, self.requeue_signal)
        self.previous = {signum: signal.signal(signum, self._handle) for signum in signums}
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)  # as set_wakeup_fd requires
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        self._watchdog = threading.Thread(target=self._watch, name="stop-deadline", daemon=True)
        self._watchdog.start()
        return self

    def requeue_if_asked(self) -> None:
        """After the stop's checkpoint: let submitit's own handler requeue the job (task 0 asks SLURM,
        or the local executor, and exits; the other tasks return and exit)."""
        handler = self.previous.get(self.requeue_signal)
        if self.requeue_asked and callable(handler):
            handler(self.requeue_signal, None)

    def __exit__(self, exc_type, exc, traceback) -> None:
        if isinstance(exc, SystemExit):  # the stop, or submitit's exit after a requeue, ends the process:
            shut_down_workers()  # now, as at the exit a loader worker still starting would print a traceback
        if isinstance(exc, Interrupted):
            return  # on the way out: the watchdog stays, so a second Ctrl-C during shutdown exits at once
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        os.write(self._wakeup_write, b"\0")  # ends the watchdog
        self._watchdog.join()
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)

    def _handle(self, signum, frame) -> None:
        # The loop's view of the signals; the watchdog acts on them even when this runs late.
        if signum == self.requeue_signal:
            self.requeue_asked = True
        if not self.received:
            self.received = signum

    def _watch(self) -> None:
        first, requeue, deadline = 0, False, None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._wakeup_read], [], [], timeout)[0]:
                self._at_boundary_lock.acquire()  # never released if this gives up
                if self._at_boundary:
                    self._at_boundary_lock.release()
                    deadline = None  # the stop's save may take what time is left
                    continue
                self._give_up(first, requeue)
            for signum in os.read(self._wakeup_read, 64):
                if signum == 0:
                    return
                if signum not in self.previous:
                    continue  # another signal with a Python handler
                requeue = requeue or signum == self.requeue_signal
                if not first:
                    first, deadline = signum, time.monotonic() + self.deadline_s
                elif signum == signal.SIGINT:
                    if self.saved_step is None:
                        message = "interrupted again: exiting at once, without a checkpoint of this step (the last saved one is intact)"
                    else:
                        message = f"interrupted again: exiting at once (the checkpoint of step {self.saved_step} is saved)"
                    os.write(2, f"error: {message}\n".encode())
                    _exit_now(128 + signal.SIGINT)

    def _give_up(self, signum: int, requeue: bool) -> None:
        name = signal.Signals(signum).name
        then = "; submitit requeues the job, which resumes from its last checkpoint" if requeue else ""
        _log_briefly(f"{name}: no step boundary within {self.deadline_s:g} s, exiting without a checkpoint{then}")
        code = 128 + signum
        handler = self.previous.get(self.requeue_signal)
        if requeue and callable(handler):
            try:
                handler(self.requeue_signal, None)  # task 0 requeues the job and exits (SystemExit here)
            except SystemExit as requeued:
                code = requeued.code if isinstance(requeued.code, int) else 1
            except Exception as error:  # submitit refuses (e.g. timed out too many times): say why
                _log_briefly(f"submitit did not requeue the job: {error}")
        _exit_now(code)

    def stop_requested(self, step: int, epoch_ends: bool, agreed: int | None = None) -> int:
        """The stop signal's number on every rank at the first check after any rank got one (all stop
        at the same step), else 0. `agreed`: the ranks' largest signal, where they have just agreed on
        it (the monitor's collective at log steps and epoch ends), which saves a collective."""
        stop = self.received
        if self.distributed:
            if step % self.check_every_n_steps and not epoch_ends:
                return 0
            if agreed is not None:
                stop = agreed
            else:
                flag = torch.tensor([self.received], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = int(flag.item())
        if stop:
            with self._at_boundary_lock:  # waits forever if the watchdog has given up: it is exiting
                self._at_boundary = True
        return stop

    def stopped(self, signum: int, step: int, epoch: int) -> Interrupted:
        """After the stop's checkpoint: the console's one line, submitit's requeue if it asked; raise what this returns."""
        self.saved_step = step
        interrupted = Interrupted(signum, step)
        if self.is_main:
            then = "submitit requeues the job, which resumes from it" if self.requeue_asked else f"continue with  {self.relaunch}"
            console.warning("%s (epoch %d); checkpoint saved: %s", interrupted, epoch, then)
        else:
            console.info("%s", interrupted)
        self.requeue_if_asked()
        return interrupted


def _log_briefly(message: str) -> None:
    """Logs an error from the watchdog, waiting at most 1 s: the blocked main thread may hold the
    logging locks."""
    said = threading.Thread(target=log.error, args=("%s", message), daemon=True)
    said.start()
    said.join(timeout=1.0)


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
