"""Models. Each is built as `_target_(num_classes=..., in_channels=..., **cfg)`; model.weights_path
then loads local weights into it (models/weights.py)."""

from torch import nn

from ddp.config import instantiate_checked
from models.weights import load_weights


def build_model(model_cfg, num_classes: int, in_channels: int) -> nn.Module:
    builder_cfg = {key: value for key, value in model_cfg.items() if key != "weights_path"}
    model = instantiate_checked(builder_cfg, "model", num_classes=num_classes, in_channels=in_channels)
    if model_cfg.get("weights_path") is not None:
        load_weights(model, model_cfg["weights_path"], num_classes)
    return model
