"""model.weights_path: local pretrained weights, loaded into a freshly built model before SyncBN
conversion and wrapping. Nothing is downloaded, and nothing pickled is run."""

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ddp.checkpoints.checkpoint import CheckpointError, load_checkpoint
from ddp.config.schema import ConfigError

log = logging.getLogger(__name__)

# Key prefixes that wrappers add: DDP / DataParallel, and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_weights(model: nn.Module, path: str, num_classes: int) -> None:
    """Load a torchvision or timm state_dict (.pt/.pth, or .safetensors) or one of our checkpoints
    (its `model`). A classifier head whose shape differs (another num_classes) is skipped and logged;
    any other difference is a one-line error."""
    state = {_strip_prefixes(key): value for key, value in read_state_dict(Path(path)).items()}
    own = model.state_dict()
    head = sorted(key for key in own.keys() & state.keys() if _is_other_head(state[key], own[key], num_classes))
    for key in head:
        del state[key]
    missing = sorted(own.keys() - state.keys() - set(head))
    unexpected = sorted(state.keys() - own.keys())
    reshaped = [f"{key} {list(state[key].shape)} vs {list(own[key].shape)}"
                for key in sorted(own.keys() & state.keys()) if state[key].shape != own[key].shape]
    if missing or unexpected or reshaped:
        raise ConfigError(f"model.weights_path={path}: does not fit this model (check model.name and the data's channels): "
                          f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, different shapes {reshaped[:5]}"
                          f"{' (first 5 of each)' if max(len(missing), len(unexpected), len(reshaped)) > 5 else ''}")
    model.load_state_dict(state, strict=False)  # strict but for the skipped head, checked above
    if head:
        log.warning("model.weights_path=%s: skipped the classifier head %s (the file's has another number of classes "
                    "than this data's %d): it starts from a fresh initialisation", path, head, num_classes)
    log.info("loaded weights from %s", path)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConfigError(f"model.weights_path={path}: not found; pass a local .pt/.pth/.safetensors file")
    if path.suffix == ".safetensors":
        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            raise ConfigError(f"model.weights_path={path}: unreadable safetensors file ({error})") from None
    try:
        content = load_checkpoint(path)
    except CheckpointError as error:
        raise ConfigError(f"model.weights_path: {error}; save model.state_dict() instead") from None
    for nested in ("model", "state_dict"):  # our checkpoints; timm's training checkpoints
        if isinstance(content, dict) and isinstance(content.get(nested), dict):
            content = content[nested]
            break
    if not (isinstance(content, dict) and content and all(isinstance(v, torch.Tensor) for v in content.values())):
        raise ConfigError(f"model.weights_path={path}: not a state_dict (a dict of tensors, or a checkpoint with "
                          "a `model` or `state_dict` entry)")
    return content


def _strip_prefixes(key: str) -> str:
    """Wrappers nest in any order (torch.compile(DDP(m)) saves `_orig_mod.module.*`): strip until none is left."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def _is_other_head(theirs: torch.Tensor, own: torch.Tensor, num_classes: int) -> bool:
    """A classifier's weight or bias: one row per class here, another number of rows in the file."""
    return own.dim() >= 1 and own.shape[0] == num_classes and theirs.shape[0] != num_classes and theirs.shape[1:] == own.shape[1:]
