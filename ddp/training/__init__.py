"""One update and the loop's measures: the update step, optimizer and schedule, EMA, the run's length
and position, exact evaluation, the loop's housekeeping."""
