"""The pieces of a training run on one device or many, one concern per module; docs/layout.md lists every module and its concern."""
