"""Models. Each is built as `_target_(num_classes=..., in_channels=..., **cfg)`."""
