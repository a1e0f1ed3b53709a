"""Models. Each is built as `_target_(num_classes=..., in_channels=..., **options)`, its options
checked against its own signature (ddp.config.builder_options); model.weights_path then loads local
weights into it (models/weights.py), into its backbone only with model.weights_scope=backbone
(models/segmentation.py)."""

from collections.abc import Callable

from torch import nn

from ddp.config.builder_options import builder_options, instantiate_checked


def build_model(model_cfg, num_classes: int, in_channels: int, with_heads: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The model= config's model, with its weights_path loaded; then the task's trainable heads around it
    (Task.with_heads) where `with_heads` is given."""
    model = instantiate_checked(builder_options(model_cfg, "model"), "model", num_classes=num_classes, in_channels=in_channels)
    if model_cfg.get("weights_path") is not None:
        from models.segmentation import load_weights_scoped  # imports torchvision: only where weights are loaded
        load_weights_scoped(model, model_cfg["weights_path"], num_classes, model_cfg.get("weights_scope", "model"))
    return with_heads(model) if with_heads is not None else model
