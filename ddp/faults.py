"""Injected faults, a testing aid for fault tolerance. Off by default (`fault.*` = -1)."""

import logging
import os
import signal
import time

log = logging.getLogger(__name__)


def inject_fault(fault_cfg, rank: int, step: int) -> None:
    """At `fault.at_step`, make the chosen rank die, raise or stall; on the first attempt only,
    unless `fault.every_attempt` (to exhaust torchrun's --max-restarts)."""
    if step != fault_cfg.at_step:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not fault_cfg.every_attempt:
        return
    if rank == fault_cfg.kill_rank:
        log.warning("fault.kill_rank=%d: killing this rank at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == fault_cfg.raise_rank:
        raise RuntimeError(f"injected fault: fault.raise_rank={rank} at step {step}")
    if rank == fault_cfg.stall_rank:
        log.warning("fault.stall_rank=%d: stalling at step %d", rank, step)
        while True:
            time.sleep(60)
