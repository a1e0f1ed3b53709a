"""model.weights_path: local pretrained weights, loaded into a freshly built model before SyncBN
conversion and wrapping. Nothing is downloaded, and nothing pickled is run.

A file of a model with task heads (Task.with_heads: a task=simclr checkpoint, keys backbone.*,
projector.*, probe.*) loads its backbone.* into the model= config's model; where the task took the
backbone's classifier away (as task=simclr does), the file lacks it and it starts fresh. build_model
then loads the heads into a task that has them (load_heads). model.weights_scope=backbone loads only
the model's `backbone` (a detector's trunk), from a classification model's state_dict."""

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
WEIGHTS_SCOPES = ("model", "backbone")


def load_weights_scoped(model: nn.Module, path: str, num_classes: int, scope: str = "model") -> None:
    """model.weights_path with model.weights_scope: `model` loads a whole segmentation model's state_dict
    (a head for another number of classes is skipped, as models/weights.py does); `backbone` loads only
    model.backbone, leaving the heads freshly initialised."""
    if scope not in WEIGHTS_SCOPES:
        raise ConfigError(f"model.weights_scope={scope}: unknown, use one of {', '.join(WEIGHTS_SCOPES)}")
    if scope == "model":
        load_weights(model, path, num_classes)
    else:
        load_backbone_weights(model, path)


def load_backbone_weights(model: nn.Module, path: str) -> None:
    """Into model.backbone (a detector's: its `body`, the trunk its FPN reads; the FPN stays freshly
    initialised): a classification model's state_dict (its `features.` prefix, as MobileNetV3's,
    is dropped; its classifier is ignored), a backbone's own, or a whole segmentation model's (`backbone.`
    keys). Every backbone tensor must be in the file with its shape: otherwise a one-line error."""
    backbone = getattr(model, "backbone", None)
    if not isinstance(backbone, nn.Module):
        raise ConfigError("model.weights_scope=backbone: this model has no `backbone`; use model.weights_scope=model")
    if isinstance(getattr(backbone, "body", None), nn.Module):  # a detector's: the classification trunk under its FPN
        backbone = backbone.body
    state = {strip_wrapper_prefixes(key): value for key, value in read_state_dict(Path(path)).items()}
    own = backbone.state_dict()
    candidates = [{key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
                  for prefix in ("", "backbone.", "features.")]
    found = max(candidates, key=lambda candidate: len(candidate.keys() & own.keys()))
    missing = sorted(own.keys() - found.keys())
    reshaped = [f"{key} {list(found[key].shape)} vs {list(own[key].shape)}"
                for key in sorted(own.keys() & found.keys()) if found[key].shape != own[key].shape]
    if missing or reshaped:
        raise ConfigError(f"model.weights_path={path}: does not fit this model's backbone (check model.name and the "
                          f"data's channels): missing keys {missing[:5]}, different shapes {reshaped[:5]} (first 5 of each)")
    backbone.load_state_dict({key: found[key] for key in own})
    log.info("loaded the backbone's weights from %s (%d of its tensors unused: its heads)", path, len(state) - len(own))


def load_weights(model: nn.Module, path: str, num_classes: int) -> None:
    """Load a torchvision or timm state_dict (.pt/.pth, or .safetensors) or one of our checkpoints
    (its `model`). A classifier head whose shape differs (another num_classes) is skipped and logged;
    any other difference is a one-line error."""
    state = {strip_wrapper_prefixes(key): value for key, value in read_state_dict(Path(path)).items()}
    own = model.state_dict()
    state, task_heads, fresh = _backbone_of_model_with_heads(state, own, model, num_classes)
    head = sorted(key for key in own.keys() & state.keys() if _is_other_head(state[key], own[key], num_classes))
    for key in head:
        del state[key]
    missing = sorted(own.keys() - state.keys() - set(head) - set(fresh))
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
    if task_heads:  # the classifier starts fresh only where the task took the backbone's away (task=simclr)
        log.warning("model.weights_path=%s: loaded the backbone of a model with task heads (its backbone.*) and skipped "
                    "its heads %s (a task that has them loads them)%s", path, task_heads,
                    f"; the classifier {fresh}, which the file lacks, starts from a fresh initialisation" if fresh else "")
    log.info("loaded weights from %s", path)


def load_heads(trained: nn.Module, backbone: nn.Module, path: str, num_classes: int) -> None:
    """Into the task's heads of `trained` (Task.with_heads around `backbone`, whose weights are loaded
    already): the heads' tensors that the file holds, e.g. a task=simclr checkpoint's projector.* and
    probe.*. A file without heads (a plain model's) leaves them fresh; a file with heads must hold this
    task's with their shapes, but for a classifier for another number of classes (skipped, as
    load_weights skips one); otherwise a one-line error."""
    prefix = next(name for name, module in trained.named_modules() if module is backbone) + "."
    state = {strip_wrapper_prefixes(key): value for key, value in read_state_dict(Path(path)).items()}
    own = {key: value for key, value in trained.state_dict().items() if not key.startswith(prefix)}
    if not any(key.startswith(prefix) for key in state):
        log.info("model.weights_path=%s: a model without task heads; the heads %s start from a fresh initialisation",
                 path, _modules_of(own))
        return
    theirs = {key: value for key, value in state.items() if not key.startswith(prefix)}
    head = sorted(key for key in own.keys() & theirs.keys() if _is_other_head(theirs[key], own[key], num_classes))
    missing = sorted(own.keys() - theirs.keys())
    unexpected = sorted(theirs.keys() - own.keys())
    reshaped = [f"{key} {list(theirs[key].shape)} vs {list(own[key].shape)}"
                for key in sorted((own.keys() & theirs.keys()) - set(head)) if theirs[key].shape != own[key].shape]
    if missing or unexpected or reshaped:
        raise ConfigError(f"model.weights_path={path}: its task heads do not fit this task's (check task= and its options, "
                          f"e.g. task.projection_dim): missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, "
                          f"different shapes {reshaped[:5]}")
    trained.load_state_dict({key: value for key, value in theirs.items() if key not in head}, strict=False)
    if head:
        log.warning("model.weights_path=%s: skipped the head %s (the file's has another number of classes than this "
                    "data's %d): it starts from a fresh initialisation", path, head, num_classes)
    log.info("loaded the task heads %s from %s", _modules_of(theirs), path)


def _backbone_of_model_with_heads(state: dict, own: dict, model: nn.Module, num_classes: int) -> tuple[dict, list[str], list[str]]:
    """(what to load, the task heads skipped, the keys that start fresh). A model with task heads saves
    its backbone as backbone.*: where those keys fit this model better than the file's own keys do, the
    file is such a model's, and its backbone.* is what loads. Its backbone lacks the classifier (the
    task took it away), so the model's classifier (find_classifier) starts fresh. Any other file:
    (state, [], [])."""
    backbone = {key.removeprefix("backbone."): value for key, value in state.items() if key.startswith("backbone.")}
    if len(backbone.keys() & own.keys()) <= len(state.keys() & own.keys()):
        return state, [], []
    classifier = find_classifier(model, num_classes)
    fresh = [] if classifier is None else [f"{classifier[0]}.{key}" for key in classifier[1].state_dict()]
    heads = _modules_of({key: None for key in state if not key.startswith("backbone.")})
    return backbone, heads, [key for key in fresh if key not in backbone]


def _modules_of(state: dict) -> list[str]:
    """The top-level modules that a state_dict's keys belong to, e.g. ['probe', 'projector']."""
    return sorted({key.split(".", 1)[0] for key in state})


def find_classifier(model: nn.Module, num_classes: int) -> tuple[str, nn.Linear] | None:
    """(name, module) of a classification model's classifier: its last nn.Linear with num_classes
    outputs (ResNet's `fc`, small_cnn's `head.3`, ViT's `heads.head`, timm's `head.fc`); None if it has none."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
             and module.out_features == num_classes]
    return found[-1] if found else None


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


def strip_wrapper_prefixes(key: str) -> str:
    """Wrappers nest in any order (torch.compile(DDP(m)) saves `_orig_mod.module.*`): strip until none is left."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def _is_other_head(theirs: torch.Tensor, own: torch.Tensor, num_classes: int) -> bool:
    """A classifier's weight or bias: one row per class here, another number of rows in the file."""
    return own.dim() >= 1 and own.shape[0] == num_classes and theirs.shape[0] != num_classes and theirs.shape[1:] == own.shape[1:]
