"""A rank-like process that restarts its loader workers every epoch until SIGTERM, then exits cleanly."""

import signal

import torch
from torch.utils.data import TensorDataset

from ddp.distributed.env import DistEnv
from ddp.loading.loaders import build_train_loader, start_epoch


class LoaderConfig:
    batch_size = 4
    num_workers = 2


def main() -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    loader = build_train_loader(TensorDataset(torch.arange(16)), LoaderConfig, DistEnv(), seed=0, pin_memory=False)
    print("ready", flush=True)
    epoch = 0
    while not stop:
        start_epoch(loader, epoch)
        for _ in loader:
            pass
        epoch += 1
    print(f"stopped cleanly after {epoch} epochs", flush=True)


if __name__ == "__main__":
    main()
