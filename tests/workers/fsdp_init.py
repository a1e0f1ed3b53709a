"""Run under torchrun (2 ranks): small_cnn sharded as strategy=fsdp does, each part writing to the dir
given as argument:

- the model built from the same seed on every rank: the full weights its shards make up (rank 0,
  `full.pt`); one whose init depends on the rank: what sharding says (every rank, `refusal_rank<R>.txt`);
- sharded in bf16: the dtypes its layers compute in (rank 0, `bf16_dtypes.json`);
- strategy.block_types=[]: its FSDP units, and its full weights after one SGD step on a batch that
  every rank holds alike (rank 0, `root_alone.json`, `root_alone.pt`);
- what sharding warns of, for a model in which no block is found and for strategy.block_types=[]
  (rank 0, `unit_warnings.json`);
- fp16 updates through UpdateStep, in the second of which rank 1's gradient shard holds an inf: each
  rank's loss scale after each update and whether its shards changed (`inf_rank<R>.json`);
- a sharded save after each rank normalised its own batch (BatchNorm statistics that differ, as
  without SyncBN): each rank's buffers before the save (`buffers_rank<R>.pt`), and the checkpoint
  (`saved/checkpoints/step-00000001`).
"""

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ddp.checkpoints.sharded_checkpoint import save_sharded_checkpoint
from ddp.distributed.dtensor import local_tensor
from ddp.distributed.fsdp import shard_model
from ddp.distributed.process_group import release_process_groups
from ddp.training.update import UpdateStep
from models.small_cnn import SmallCNN
from tasks.classification import ClassificationTask

STRATEGY = OmegaConf.create({"name": "fsdp", "reshard_after_forward": True, "block_types": None})
CPU = torch.device("cpu")
LOCAL_WORLD_SIZE = 2  # the default shard group of hsdp, which fsdp's 1-D mesh doesn't read


def small_cnn(block_types=None, precision: str = "32"):
    torch.manual_seed(0)  # train.py seeds every rank alike before building the model
    strategy = OmegaConf.merge(STRATEGY, {"block_types": block_types})
    return shard_model(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]), strategy, CPU, precision, LOCAL_WORLD_SIZE)


def full_weights(model) -> dict:
    """The full state_dict (on rank 0; a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)


def initial_weights(out: Path, rank: int) -> None:
    full = full_weights(small_cnn())
    if rank == 0:
        torch.save(full, out / "full.pt")
    torch.manual_seed(rank)
    try:
        shard_model(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]), STRATEGY, CPU, "32", LOCAL_WORLD_SIZE)
        refusal = ""
    except RuntimeError as error:
        refusal = str(error)
    (out / f"refusal_rank{rank}.txt").write_text(refusal)


def bf16_dtypes(out: Path, rank: int) -> None:
    model = small_cnn(precision="bf16")
    dtypes = {"parameters": sorted({str(p.dtype) for p in model.parameters()})}

    def record(name):  # runs after FSDP's own pre-forward hook: the inputs cast, the weight gathered
        def hook(module, inputs):
            dtypes[name] = {"input": str(inputs[0].dtype), "weight": str(module.weight.dtype)}
        return hook

    model.features[0].register_forward_pre_hook(record("conv"))
    model.features[1].register_forward_pre_hook(record("batchnorm"))
    dtypes["model_output"] = str(model(torch.randn(4, 3, 8, 8)).dtype)
    if rank == 0:
        (out / "bf16_dtypes.json").write_text(json.dumps(dtypes))


def root_alone(out: Path, rank: int) -> None:
    model = small_cnn(block_types=[])
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, targets = batch(1)
    torch.nn.functional.cross_entropy(model(images), targets).backward()
    optimizer.step()
    full = full_weights(model)
    if rank == 0:
        (out / "root_alone.json").write_text(json.dumps({"units": units}))
        torch.save(full, out / "root_alone.pt")


def unit_warnings(out: Path, rank: int) -> None:
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ddp.distributed.fsdp").addHandler(handler)
    torch.manual_seed(0)
    shard_model(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10)), STRATEGY, CPU, "32", LOCAL_WORLD_SIZE)  # no class of a block
    found_none = list(warnings)
    small_cnn(block_types=[])
    logging.getLogger("ddp.distributed.fsdp").removeHandler(handler)
    if rank == 0:
        (out / "unit_warnings.json").write_text(json.dumps({"found_none": found_none, "asked_for_none": warnings[len(found_none):]}))


def inf_on_one_rank(out: Path, rank: int) -> None:
    model = small_cnn(precision="16")
    update = UpdateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), task=ClassificationTask(10),
                        precision="16")
    poison = [False]

    def inf_into_the_shard(param):  # FSDP calls it with the sharded parameter, its gradient just reduce-scattered
        if poison[0] and rank == 1:
            param.grad.to_local().view(-1)[0] = float("inf")

    next(model.parameters()).register_post_accumulate_grad_hook(inf_into_the_shard)
    record = {"scales": [], "changed": []}
    for poison[0] in (False, True):
        before = [local_tensor(p).detach().clone() for p in model.parameters()]
        update.micro_step(batch(2 + rank), micro_index=0, group_size=1)
        record["scales"].append(update.scaler.get_scale())
        record["changed"].append(any(not torch.equal(local_tensor(p), b) for p, b in zip(model.parameters(), before, strict=True)))
    (out / f"inf_rank{rank}.json").write_text(json.dumps(record))


def buffers_saved(out: Path, rank: int) -> None:
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, targets = batch(10 + rank)  # each rank its own batch, so its own BatchNorm statistics
    torch.nn.functional.cross_entropy(model(images), targets).backward()
    optimizer.step()
    torch.save({name: buffer.clone() for name, buffer in model.named_buffers()}, out / f"buffers_rank{rank}.pt")
    publish = save_sharded_checkpoint(model, optimizer, {}, out / "saved", step=1, keep_last=1)
    publish()  # every rank: the shards hashed, rank 0 publishes the dir


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for part in (initial_weights, bf16_dtypes, root_alone, unit_warnings, inf_on_one_rank, buffers_saved):
        part(out, rank)
    dist.barrier()
    dist.destroy_process_group()
    release_process_groups()  # as train.py does: no gloo thread still at work as Python exits


if __name__ == "__main__":
    main(Path(sys.argv[1]))
