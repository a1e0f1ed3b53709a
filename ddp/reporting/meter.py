"""What a run measures about itself: steady-state training throughput, the time spent waiting for
data, each rank's own compute time (which shows a straggler), and peak memory, all per run."""

import resource
import statistics
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn


class ThroughputMeter:
    """Global samples per second over training steps only, and the share of those steps' time spent
    waiting for the next batch.

    The clock starts once this process has done `warmup_steps` steps and runs only while training:
    the loop pauses it for evaluation, checkpoints and epoch-end work. On CUDA it is read after
    synchronising, and only where the loop pauses or resumes it, never on an ordinary step.
    """

    def __init__(self, warmup_steps: int, device: torch.device):
        self.warmup_steps = warmup_steps
        self.device = device
        self.steps = 0  # done by this process, resumed runs included
        self.samples = 0
        self.seconds = 0.0
        self.running_since: float | None = None
        self.wait_seconds = 0.0  # of `seconds`, spent waiting for the next batch
        self._window_start = (0.0, 0.0)  # (seconds, wait_seconds) at the last `window_data_wait()`

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the work done, not the work queued
        return time.perf_counter()

    def resume(self) -> None:
        if self.steps >= self.warmup_steps:
            self.running_since = self._now()

    def pause(self) -> None:
        if self.running_since is not None:
            self.seconds += self._now() - self.running_since
            self.running_since = None

    def step(self, global_samples: int) -> None:
        self.steps += 1
        if self.running_since is not None:
            self.samples += global_samples
        elif self.steps == self.warmup_steps:
            self.resume()

    def timed(self, batches: Iterable) -> Iterator:
        """`batches`, with the time each takes to arrive counted as data wait (while the clock runs)."""
        iterator = iter(batches)
        while True:
            asked = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            if self.running_since is not None:
                self.wait_seconds += time.perf_counter() - asked
            yield item

    def _elapsed(self) -> float:
        return self.seconds + (time.perf_counter() - self.running_since if self.running_since is not None else 0.0)

    def window_data_wait(self) -> float:
        """The share of this process's timed training time since the last call spent waiting for the
        next batch (0 in the warm-up). Read it where the loop has waited for the device (log steps)."""
        now = (self._elapsed(), self.wait_seconds)
        seconds, wait = now[0] - self._window_start[0], now[1] - self._window_start[1]
        self._window_start = now
        return wait / seconds if seconds else 0.0

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.seconds if self.samples else None

    @property
    def data_wait_fraction(self) -> float:
        """The share of all timed training time spent waiting for the next batch: high means raise num_workers."""
        return self.wait_seconds / self.seconds if self.seconds else 0.0


class ComputeTimer:
    """This rank's own compute per update: from the start of the model's forward to the moment backward
    has produced the gradient of the model's first parameter, summed over the update's micro-batches.

    Under DDP every rank's step lasts as long as the slowest rank's, since all wait at the gradient
    all-reduce, so step times can't show a slow rank; this time stops before that wait. It starts
    inside DDP's forward, after DDP's buffer broadcast (the other collective of a step), and ends
    with the last gradient backward computes: the first parameter's, one bucket's all-reduce before
    the end. Host clock on CPU; on CUDA, events recorded on the stream and read only at log steps,
    where the loop has already waited for the device.

    The run's figure (`per_update`) leaves out the first `warmup_updates`, as samples/s does: on a GPU
    the first update also loads libraries and picks kernels, which would read as this rank's compute.
    """

    def __init__(self, module: nn.Module, device: torch.device, warmup_updates: int = 0):
        self.cuda = device.type == "cuda"
        self.window_seconds, self.window_updates = 0.0, 0
        self.total_seconds, self.total_updates = 0.0, 0  # after the warm-up
        self.warmup_updates, self.updates = warmup_updates, 0
        self._warmup_in_window = (0.0, 0, 0)  # the open window's warm-up: host seconds, event pairs, updates
        self._all_seconds, self._all_updates = 0.0, 0  # warm-up included: the figure of a run that is all warm-up
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started: float | torch.cuda.Event | None = None
        first = next(parameter for parameter in module.parameters() if parameter.requires_grad)
        module.register_forward_pre_hook(self._start)
        first.register_post_accumulate_grad_hook(self._end)

    def _start(self, module, args) -> None:
        if not module.training or threading.current_thread() is not threading.main_thread():
            return  # evaluation; or DataParallel's replicas, each in a thread of its own (not timed)
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def _end(self, parameter) -> None:
        if self._started is None:
            return
        if self.cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._pending.append((self._started, ended))
        else:
            self.window_seconds += time.perf_counter() - self._started
        self._started = None

    def update_done(self) -> None:
        self.window_updates += 1
        self.updates += 1
        if self.updates <= self.warmup_updates:
            self._warmup_in_window = (self.window_seconds, len(self._pending), self.window_updates)

    def window_per_update(self) -> float:
        """Seconds of compute per update since the last call (call where the device has caught up)."""
        timed = [start.elapsed_time(end) / 1000 for start, end in self._pending]
        warmup_seconds, warmup_pairs, warmup_updates = self._warmup_in_window
        window_seconds = self.window_seconds + sum(timed)
        per_update = window_seconds / self.window_updates if self.window_updates else 0.0
        self.total_seconds += window_seconds - warmup_seconds - sum(timed[:warmup_pairs])
        self.total_updates += self.window_updates - warmup_updates
        self._all_seconds += window_seconds
        self._all_updates += self.window_updates
        self._pending.clear()
        self.window_seconds, self.window_updates, self._warmup_in_window = 0.0, 0, (0.0, 0, 0)
        return per_update

    @property
    def per_update(self) -> float:
        """Over the run so far after the warm-up, or over all of it if it was all warm-up (call
        `window_per_update` first to count the open window)."""
        if self.total_updates:
            return self.total_seconds / self.total_updates
        return self._all_seconds / self._all_updates if self._all_updates else 0.0


def straggler_stats(per_rank: list[float]) -> dict[str, float]:
    """min, median and max of the ranks' compute per update, and max / median: about 1 when the
    ranks are even; a rank at twice the others' time reads 2 with 3 or more ranks (4/3 with 2)."""
    ordered = sorted(per_rank)
    median = statistics.median(ordered)
    return {"compute_s_per_update_min": ordered[0], "compute_s_per_update_median": median,
            "compute_s_per_update_max": ordered[-1], "straggler_ratio": ordered[-1] / median if median else 1.0}


_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def reset_peak_memory(cuda_devices: list[int]) -> bool:
    """Start this run's high-water marks: each GPU's allocator peak, or the process's peak RSS.
    False where the RSS peak can't be reset (not Linux): it is then the process's."""
    if cuda_devices:
        if torch.cuda.is_initialized():  # else nothing was allocated yet, and torch refuses to reset (no allocator)
            for index in cuda_devices:
                torch.cuda.reset_peak_memory_stats(index)
        return True
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_memory(cuda_devices: list[int], reset: bool) -> tuple[float, str]:
    """(MiB, where): the largest allocator peak over `cuda_devices` and its device, else the peak RSS."""
    if cuda_devices:
        peaks = {index: torch.cuda.max_memory_allocated(index) for index in cuda_devices}
        index = max(peaks, key=peaks.get)
        return peaks[index] / 2**20, f"cuda:{index}"
    if reset:
        high_water = next(line for line in _STATUS.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(high_water.split()[1]) / 1024, "cpu"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu (process lifetime)"
