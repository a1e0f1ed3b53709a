"""torch.profiler over a few chosen updates, and CUDA memory snapshots, each rank writing its own files
into the run dir's profiler/ folder (docs/profiling.md). Off (the default), none of it runs: no profiler
context, and no record_function on the hot path, since the phase marks are wrappers installed on the
loop's objects only when profiling."""

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

from ddp.run_context import RunContext

log = logging.getLogger("train")

PROFILER_DIR = "profiler"  # in the run dir
DATA_WAIT, VALIDATION, CHECKPOINT_SAVE = "data_wait", "validation", "checkpoint_save"  # phase names in the trace
MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept (a ring buffer: the newest), several KB each


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory under profiler.memory_history: one line naming the rank and its snapshot."""


def _marked(phase: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def marked(*args, **kwargs):
        with record_function(phase):
            return method(*args, **kwargs)
    return marked


def marked_batches(batches: Iterable) -> Iterator:
    """`batches`, with the wait for each marked as data_wait in the trace."""
    iterator = iter(batches)
    while True:
        with record_function(DATA_WAIT):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


class StepProfiler:
    """torch.profiler with a wait/warmup/active schedule over the updates, a context manager stepped
    after each update (RunMonitor does both). Its trace is written when the active updates are done (or
    the run ends first) to profiler/rank<R>_step<N>.json.gz, N the global step of the last update traced;
    Perfetto (ui.perfetto.dev) and chrome://tracing open it. Rank 0 logs the key-averages table at the end."""

    def __init__(self, ctx: RunContext):
        cfg = ctx.cfg.profiler
        self.rank, self.is_main, self.table_rows = ctx.env.rank, ctx.env.is_main, cfg.table_rows
        self.dir = ctx.run_dir / PROFILER_DIR
        self.global_step = 0  # of the last update, for the trace's name
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        self.profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._write_trace,
        )

    def mark_phases(self, update, validator, checkpointer) -> None:
        """record_function around the update's phases (UpdateStep.PHASES), validation and checkpoint saves."""
        for owner, methods in ((update, {name: name for name in update.PHASES}),
                               (validator, {"validate": VALIDATION}), (checkpointer, {"save": CHECKPOINT_SAVE})):
            for method, phase in methods.items():
                setattr(owner, method, _marked(phase, getattr(owner, method)))

    def __enter__(self) -> "StepProfiler":
        self.profile.__enter__()
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.profile.__exit__(exc_type, *exc_info)
        if self.is_main and self.table_rows and exc_type is None:
            sort_by = "self_cuda_time_total" if ProfilerActivity.CUDA in self.profile.activities else "self_cpu_time_total"
            table = self.profile.key_averages().table(sort_by=sort_by, row_limit=self.table_rows)
            log.info("profiler: rank 0's key averages over the traced updates (trace files in %s):\n%s", self.dir, table)

    def step(self, global_step: int) -> None:
        """After update `global_step`: the schedule moves on (and may write the trace)."""
        self.global_step = global_step
        self.profile.step()

    def _write_trace(self, profile: torch.profiler.profile) -> None:
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"rank{self.rank}_step{self.global_step}.json.gz"
        profile.export_chrome_trace(str(path))
        log.info("profiler: trace of updates up to step %d written to %s", self.global_step, path)


def dump_memory_snapshot(run_dir: Path, name: str) -> Path:
    """This rank's recorded CUDA memory history as a pickle for pytorch.org/memory_viz."""
    path = run_dir / PROFILER_DIR / name
    path.parent.mkdir(exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return path


@contextlib.contextmanager
def cuda_memory_history(ctx: RunContext) -> Iterator[None]:
    """profiler.memory_history: record CUDA allocations from here; on an out-of-memory error dump this
    rank's snapshot and raise OutOfMemory, one line. Off, it does nothing (validate refused it without CUDA)."""
    if not ctx.cfg.profiler.memory_history:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        path = dump_memory_snapshot(ctx.run_dir, f"memory_rank{ctx.env.rank}_oom.pickle")
        reason = str(error).strip().splitlines()[0]
        raise OutOfMemory(f"rank {ctx.env.rank}: CUDA out of memory ({reason}); its memory snapshot is {path} "
                          "(open it at pytorch.org/memory_viz): lower data.batch_size, or try precision=bf16") from None
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
