"""A model for tests: small_cnn that appends, at each training forward, whether Python's cyclic garbage collector is
on and how many objects it leaves out of its scans (gc.freeze), to the file `record` names: "1 570000", a line each.

    python train.py model._target_=tests.workers.collector_state.CollectorState +model.record=collector.txt ...
"""

import gc

from models.small_cnn import SmallCNN


class CollectorState(SmallCNN):
    def __init__(self, num_classes: int, in_channels: int, channels: list[int], record: str, **options):
        super().__init__(num_classes, in_channels, channels, **options)
        self.record = record

    def forward(self, x):
        if self.training:
            with open(self.record, "a") as file:
                file.write(f"{int(gc.isenabled())} {gc.get_freeze_count()}\n")
        return super().forward(x)
