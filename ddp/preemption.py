"""SIGTERM (preemption, or torchrun stopping its workers): finish the step, save, then exit."""

import logging
import os
import signal
import threading

import torch

from ddp.process_group import all_reduce_sum

log = logging.getLogger(__name__)


# torchrun force-kills 30 s after its SIGTERM: leave time to save once at a check step.
STEP_BOUNDARY_GRACE_S = 20.0


class StopOnSigterm:
    """Records SIGTERM instead of dying at once, so the loop can checkpoint at a step boundary.

    Under DDP the ranks agree to stop only every `check_every_n_steps` steps and at an epoch's last
    step, where the loop already waits for the device (loss logging, epoch totals): the other steps
    do no collective and no host sync. A rank that doesn't reach a check in time (stalled, or
    blocked in a collective whose peer is gone) exits with 143 rather than holding up the shutdown.
    """

    def __init__(self, distributed: bool, check_every_n_steps: int):
        self.distributed = distributed
        self.check_every_n_steps = check_every_n_steps
        self.received = False
        self.deadline: threading.Timer | None = None
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM received: saving a checkpoint after this step")
        self.received = True
        if self.deadline is None:
            self.deadline = threading.Timer(STEP_BOUNDARY_GRACE_S, self._give_up)
            self.deadline.daemon = True
            self.deadline.start()

    @staticmethod
    def _give_up() -> None:
        log.error("SIGTERM: no step boundary within %.0f s, exiting without a checkpoint", STEP_BOUNDARY_GRACE_S)
        logging.shutdown()
        os._exit(143)

    def stop_now(self, step: int, epoch_ends: bool, device: torch.device) -> bool:
        """True on every rank at the first check after any rank got the signal, so all stop at the same step."""
        stop = self.received
        if self.distributed:
            if step % self.check_every_n_steps and not epoch_ends:
                return False
            stop = all_reduce_sum(torch.tensor([float(self.received)], device=device)).item() > 0
        if stop and self.deadline is not None:
            self.deadline.cancel()  # at the boundary now: the save may take what time is left
        return stop
