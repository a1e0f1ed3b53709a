"""Where a process stands and how the processes work together: env, process group, DTensor helpers,
FSDP, SyncBN, wrapping."""
