"""Models. Each is built as `_target_(num_classes=..., in_channels=..., **cfg)`; model.weights_path
then loads local weights into it (models/weights.py), into its backbone only with
model.weights_scope=backbone (models/segmentation.py)."""

from torch import nn

from ddp.config import instantiate_checked
from models.segmentation import load_weights_scoped

WEIGHTS_KEYS = ("weights_path", "weights_scope")  # for build_model, not the builder


def build_model(model_cfg, num_classes: int, in_channels: int) -> nn.Module:
    builder_cfg = {key: value for key, value in model_cfg.items() if key not in WEIGHTS_KEYS}
    model = instantiate_checked(builder_cfg, "model", num_classes=num_classes, in_channels=in_channels)
    if model_cfg.get("weights_path") is not None:
        load_weights_scoped(model, model_cfg["weights_path"], num_classes, model_cfg.get("weights_scope", "model"))
    return model
