"""What survives the process: saving, loading, sharded dirs, resuming, exporting, and which checkpoints
are kept as best."""
