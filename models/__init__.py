"""Models. Each is built as `_target_(num_classes=..., in_channels=..., **options)`, its options
checked against its own signature (ddp.config.builder_options); model.weights_path then loads local
weights into it, or into its backbone only with model.weights_scope=backbone (models/weights.py), and
the task's trainable heads go around it (Task.with_heads), with the heads' weights where the file has
them (a task=simclr checkpoint's projector and probe)."""

from collections.abc import Callable

from torch import nn

from ddp.config.builder_options import builder_options, instantiate_checked


def build_model(model_cfg, num_classes: int, in_channels: int, with_heads: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The model= config's model, with its weights_path loaded; then the task's trainable heads around it
    (Task.with_heads) where `with_heads` is given, and the heads' weights that weights_path holds. The
    backbone loads first, as the model= config built it: with_heads may take its classifier away."""
    model = instantiate_checked(builder_options(model_cfg, "model"), "model", num_classes=num_classes, in_channels=in_channels)
    weights_path = model_cfg.get("weights_path")
    if weights_path is not None:
        from models.weights import load_heads, load_weights_scoped  # safetensors: only where weights are loaded

        load_weights_scoped(model, weights_path, num_classes, model_cfg.get("weights_scope", "model"))
    if with_heads is None:
        return model
    trained = with_heads(model)
    if weights_path is not None and trained is not model:
        load_heads(trained, model, weights_path, num_classes)
    return trained
