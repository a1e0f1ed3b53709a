"""A Hydra callback for tests: rank 0 held back inside Hydra's start of the job, as a busy host stalls
one rank. It registers `${rank_zero_sleeps:SECONDS}`, which sleeps that long on rank 0 when resolved.
Hydra resolves its job logging config in run_job after making the run dir and before opening the rank's
log file there, so set in it, it delays rank 0 while the other ranks go on:

    torchrun ... train.py ... +hydra.callbacks.slow_start._target_=tests.workers.slow_start.SlowStart \
        '+hydra.job_logging.slow_start=${rank_zero_sleeps:3}'

(logging's dictConfig ignores the extra key.)
"""

import os
import time

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf


def _sleep_on_rank_zero(seconds: float) -> str:
    if os.environ.get("RANK", "0") == "0":
        time.sleep(seconds)
    return ""


class SlowStart(Callback):
    def __init__(self) -> None:
        OmegaConf.register_new_resolver("rank_zero_sleeps", _sleep_on_rank_zero, replace=True)
