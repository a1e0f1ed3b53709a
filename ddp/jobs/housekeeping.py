"""What the training loop does besides updating, one object per concern: train.py's `fit` builds
them and its loop consults them between updates, in the order written there. It composes the layers
below (training, checkpoints, reporting, and the signals of jobs/), so it sits above them all."""

from dataclasses import dataclass

from ddp.checkpoints.best import BestTracker
from ddp.checkpoints.checkpointer import Checkpointer
from ddp.jobs.preemption import StopOnSignal
from ddp.reporting.monitor import RunMonitor
from ddp.training.evaluation import Validator
from ddp.training.faults import SampleRecorder


@dataclass(frozen=True)
class Housekeeping:
    stopper: StopOnSignal  # SIGTERM, Ctrl-C, submitit's requeue: stop at a step boundary, saved
    monitor: RunMonitor  # progress, training scalars, meters, fault aids, the non-finite check
    checkpointer: Checkpointer  # periodic and best saves
    validator: Validator  # validation of the saved model (and its EMA weights)
    best: BestTracker  # which validations are kept as best; early stopping
    recorder: SampleRecorder | None  # fault.record_samples_dir: the samples trained (a testing aid), else None
