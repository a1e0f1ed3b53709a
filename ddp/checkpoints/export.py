"""`make export CKPT=<checkpoints/step-N dir>`: a sharded checkpoint's model as one plain state_dict
file, `<dir>/model.pt`, that loads with torch.load(weights_only=True) into the bare model and that
model.weights_path takes. Written atomically, as every checkpoint."""

import sys
from pathlib import Path

from ddp.checkpoints.checkpoint import CheckpointError, is_sharded_checkpoint, save_checkpoint
from ddp.checkpoints.sharded_checkpoint import full_model_state

EXPORTED = "model.pt"


def export_model(checkpoint: Path) -> Path:
    """Write `checkpoint`/model.pt (full tensors, one process) and return its path."""
    if not is_sharded_checkpoint(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a complete sharded checkpoint (strategy=fsdp's checkpoints/step-N dir "
                              "with .metadata and state.pt); a checkpoint file is one plain file already")
    path = checkpoint / EXPORTED
    save_checkpoint(full_model_state(checkpoint), path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ddp.checkpoints.export <checkpoints/step-N dir>   (or: make export CKPT=<dir>)")
    try:
        print(export_model(Path(sys.argv[1])))
    except CheckpointError as error:
        sys.exit(f"error: {error}")
