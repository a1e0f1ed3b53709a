"""`make bench`'s Lightning contender (the optional `.[bench]` extra): the plain loop's work
(benchmarks/plain_ddp.py: same model, synthetic data, Adam, cross-entropy, batch per process) as a
LightningModule, trained by Lightning's Trainer with its DDP strategy under torchrun, everything it
adds by default that a benchmark doesn't want turned off (checkpoints, logger, progress bar,
model summary, sanity validation). Same throughput definition: global samples per second after
`--warmup` steps. Prints one JSON line on rank 0.

    torchrun --nproc_per_node=2 benchmarks/lightning_ddp.py --model small_cnn --steps 40
"""

import json
import os
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data.synthetic import build_synthetic
from plain_ddp import MODELS, parse_arguments


class Classifier(L.LightningModule):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_index):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StepClock(L.Callback):
    """The time from the end of the warm-up's last step to the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.started, self.ended = warmup, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if trainer.global_step == self.warmup:
            self._sync(module)
            self.started = time.perf_counter()
        self.ended = time.perf_counter()

    def on_train_end(self, trainer, module):
        self._sync(module)
        self.ended = time.perf_counter()

    @staticmethod
    def _sync(module):
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)


def main() -> None:
    args = parse_arguments()

    cuda = torch.cuda.is_available()
    trainer_clock = StepClock(args.warmup)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[trainer_clock])
    torch.manual_seed(0)
    samples = (args.warmup + args.steps) * args.batch_size * trainer.world_size
    train = build_synthetic(samples, 1, args.image_size, num_classes=10, channels=3, data_seed=0).train
    trainer.fit(Classifier(MODELS[args.model]()), DataLoader(train, batch_size=args.batch_size, shuffle=True))
    seconds = trainer_clock.ended - trainer_clock.started
    if trainer.is_global_zero:
        print(json.dumps({"samples_per_s": args.steps * args.batch_size * trainer.world_size / seconds}))


if __name__ == "__main__":
    main()
