"""Run under torchrun: shard small_cnn as strategy=fsdp does, built from the same seed on every rank, and
write the full weights its shards make up (rank 0); then try one whose init depends on the rank, and
write what sharding says (every rank); then shard one in bf16 and write the dtypes its layers compute
in (rank 0)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ddp.fsdp import shard_model
from models.small_cnn import SmallCNN

STRATEGY = OmegaConf.create({"name": "fsdp", "reshard_after_forward": True, "block_types": None})


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # train.py seeds every rank alike before building the model
    model = shard_model(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]), STRATEGY, torch.device("cpu"), "32")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # on rank 0
    if rank == 0:
        torch.save(full, out / "full.pt")
    torch.manual_seed(rank)
    try:
        shard_model(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]), STRATEGY, torch.device("cpu"), "32")
        refusal = ""
    except RuntimeError as error:
        refusal = str(error)
    (out / f"refusal_rank{rank}.txt").write_text(refusal)
    torch.manual_seed(0)
    model = shard_model(SmallCNN(num_classes=10, in_channels=3, channels=[8, 16]), STRATEGY, torch.device("cpu"), "bf16")
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
