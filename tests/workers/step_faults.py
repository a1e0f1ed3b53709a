"""A model for tests: small_cnn that appends, at each training forward, the minor page faults its process has taken
so far to the file `record` names (one line each), so that consecutive lines differ by one whole training step's
faults: its backward, its optimizer step and the next batch's loading. Subclasses record something else (`measure`).

    python train.py model._target_=tests.workers.step_faults.StepFaults +model.record=faults.txt ...
"""

import resource

from models.small_cnn import SmallCNN


class StepFaults(SmallCNN):
    def __init__(self, num_classes: int, in_channels: int, channels: list[int], record: str, **options):
        super().__init__(num_classes, in_channels, channels, **options)
        self.record = record

    def measure(self) -> str:
        return str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def forward(self, x):
        if self.training:
            with open(self.record, "a") as file:
                file.write(f"{self.measure()}\n")
        return super().forward(x)
