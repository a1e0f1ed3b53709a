"""Where a process stands and how the processes work together: env and devices, process group, DTensor
helpers, FSDP, SyncBN."""
