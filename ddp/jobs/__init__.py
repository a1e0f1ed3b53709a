"""The job around the run: launching, the run dir and its lock, what a launch's processes agree on,
signals, the loop's housekeeping, how a job ends, a sweep's summary."""
