"""What a run measures about itself: steady-state training throughput, the time spent waiting for
data, and peak memory, all per run."""

import resource
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


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


_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def reset_peak_memory(cuda_devices: list[int]) -> bool:
    """Start this run's high-water marks: each GPU's allocator peak, or the process's peak RSS.
    False where the RSS peak can't be reset (not Linux): it is then the process's."""
    for index in cuda_devices:
        torch.cuda.reset_peak_memory_stats(index)
    if cuda_devices:
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
