"""The job around the run: launching, the run dir and its lock, what a launch's processes agree on,
signals, how a job ends, injected faults."""
