"""A rank-like process that stops as the training loop does on Ctrl-C (`Interrupted` out of
`StopOnSignal`, with the loader's iterator held by the loop's frame) right after its first batch,
while its second loader worker is still starting: that worker takes 3 s longer to unpickle its
dataset, which comes before its queues. Prints whether it was still starting when the stop came."""

import signal
import sys
import time
from pathlib import Path

from torch.utils.data import Dataset

from ddp.distributed.env import DistEnv
from ddp.jobs.preemption import Interrupted, StopOnSignal
from ddp.loading.loaders import build_train_loader, iterate_from, start_epoch


class SlowToStartInLaterWorkers(Dataset):
    def __init__(self, started: Path):
        self.started = started  # the slow worker creates it once it has unpickled this
        self.pickled = 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        return index

    def __getstate__(self) -> dict:
        self.pickled += 1  # in the rank: once per worker, as it starts them in order
        return {**self.__dict__, "slow": self.pickled > 1}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.slow:
            time.sleep(3)
            self.started.touch()


class LoaderConfig:
    batch_size = 4
    num_workers = 2


def main() -> None:
    started = Path(sys.argv[1])
    loader = build_train_loader(SlowToStartInLaterWorkers(started), LoaderConfig, DistEnv(), seed=0, pin_memory=False)
    start_epoch(loader, 0)
    with StopOnSignal(distributed=False, check_every_n_steps=1, deadline_s=20):
        batches = iterate_from(loader, 0)  # a local, as in train.py's loop: the stop's traceback holds it
        for _ in batches:
            print(f"a worker was still starting: {not started.exists()}", flush=True)
            interrupted = Interrupted(signal.SIGINT, step=1)
            raise interrupted


if __name__ == "__main__":
    main()
