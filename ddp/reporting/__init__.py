"""What the run tells: rank-0 output, meters, the monitor, results.json and a sweep's summary."""
