"""SIGTERM (preemption, or torchrun stopping its workers): finish the step, save, then exit."""

import logging
import signal

import torch

from ddp.process_group import all_reduce_sum

log = logging.getLogger(__name__)


class StopOnSigterm:
    """Records SIGTERM instead of dying at once, so the loop can checkpoint at a step boundary."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM received: saving a checkpoint after this step")
        self.received = True

    def stop_now(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank got the signal, so all stop at the same step."""
        return all_reduce_sum(torch.tensor([float(self.received)], device=device)).item() > 0
