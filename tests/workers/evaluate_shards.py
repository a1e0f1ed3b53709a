"""Run under torchrun: evaluate one fixed model on an odd-sized val set with train.evaluate, write rank 0's metrics."""

import json
import sys

import torch
import torch.distributed as dist

from data.synthetic import build_synthetic
from ddp.env import DistEnv
from ddp.loaders import build_val_loader
from models.small_cnn import SmallCNN
from ddp.evaluation import evaluate
from tasks.classification import ClassificationTask


class LoaderConfig:
    batch_size = 4
    num_workers = 0


def evaluate_fixed_model(env: DistEnv, num_val_samples: int) -> dict:
    """train.evaluate of one seeded model on `num_val_samples` synthetic samples, sharded for `env`."""
    splits = build_synthetic(16, num_val_samples, image_size=8, num_classes=10, channels=3, data_seed=0)
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10, in_channels=3, channels=[8, 16])
    return evaluate(model, build_val_loader(splits.val, LoaderConfig, env, pin_memory=False), torch.device("cpu"), -1, ClassificationTask())


def main(out_path: str, num_val_samples: int) -> None:
    env = DistEnv.from_environ()
    dist.init_process_group("gloo")
    metrics = evaluate_fixed_model(env, num_val_samples)
    if env.is_main:
        with open(out_path, "w") as f:
            json.dump(metrics, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
