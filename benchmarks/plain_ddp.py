"""The yardstick for `make bench`: the canonical hand-written DDP loop and nothing else.

torchrun's environment, init_process_group, DistributedSampler + set_epoch, DDP, Adam,
cross-entropy. Same model and synthetic data as train.py's, and the same throughput definition
(global samples per second after `--warmup` steps). Prints one JSON line on rank 0.

    torchrun --nproc_per_node=2 benchmarks/plain_ddp.py --model small_cnn --steps 40
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from data.synthetic import build_synthetic
from models.resnet import build_resnet18
from models.small_cnn import SmallCNN

MODELS = {
    "small_cnn": lambda: SmallCNN(num_classes=10, in_channels=3, channels=[32, 64, 128]),
    # framework-bound: a step of a few milliseconds, where the loop's own cost per step shows (at 16 px)
    "tiny_cnn": lambda: SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]),
    "resnet18": lambda: build_resnet18(num_classes=10, in_channels=3, small_input=True),
}


def parse_arguments() -> argparse.Namespace:
    """The work, as every contender script of make bench takes it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="small_cnn")
    parser.add_argument("--steps", type=int, default=40, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--image-size", type=int, default=32)
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    samples = (args.warmup + args.steps) * args.batch_size * world_size
    train = build_synthetic(samples, 1, args.image_size, num_classes=10, channels=3, data_seed=0).train
    model = DistributedDataParallel(MODELS[args.model]().to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    sampler.set_epoch(0)
    started = None
    for step, (images, labels) in enumerate(loader, start=1):
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    if rank == 0:
        print(json.dumps({"samples_per_s": args.steps * args.batch_size * world_size / seconds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
