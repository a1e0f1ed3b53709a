"""One update and the loop's measures: the model prepared and wrapped, the update step, optimizer and
schedule, EMA, the task's frozen modules, the run's length and position, exact evaluation, injected faults."""
