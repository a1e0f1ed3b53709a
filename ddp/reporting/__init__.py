"""What the run tells: rank-0 output, the trackers and their startup checks, meters, the monitor, the
profiler and results.json."""
