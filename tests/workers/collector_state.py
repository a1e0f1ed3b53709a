"""A model for tests: small_cnn that appends, at each training forward, whether Python's cyclic garbage collector is
on and how many objects it leaves out of its scans (gc.freeze), to the file `record` names: "1 313341", a line each.

    python train.py model._target_=tests.workers.collector_state.CollectorState +model.record=collector.txt ...
"""

import gc

from tests.workers.step_faults import StepFaults


class CollectorState(StepFaults):
    def measure(self) -> str:
        return f"{int(gc.isenabled())} {gc.get_freeze_count()}"
