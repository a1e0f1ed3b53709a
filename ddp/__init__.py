"""Small factories for training on one device or many: env, process group, wrapping, SyncBN, loaders, rank-0 I/O, checkpoints."""
