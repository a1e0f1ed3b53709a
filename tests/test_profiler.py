"""profiler.*: a 2-rank DDP run with the profiler on writes one trace per rank, in Chrome's trace JSON,
with the loop's phases and the profiler's step markers, rank 0 logs the key-averages table, and the
training is the same as without it; CUDA memory history is refused on CPU, and bad settings, in one line.
(The CUDA side, kernels in the trace and a memory snapshot, is tests/gpu/gpu_check.py's.)"""

import gzip
import json

import pytest

from conftest import DDP_RUN, assert_same_weights, check, config_error_in_this_process, final_weights, launch, run_dirs

# DDP_RUN has 8 updates an epoch. Updates 9-11 are traced: the first epoch's validation runs in update
# 9's profiler step, the data wait for epoch 2's first batch too, and the save at step 10 in update 11's.
PROFILED = ["profiler.enabled=true", "profiler.wait=7", "profiler.warmup=1", "profiler.active=3", "checkpoint.every_n_steps=10"]
PHASES = {"data_wait", "forward_and_loss", "backward", "optimizer_step", "validation", "checkpoint_save"}


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """ddp_run's training (torchrun, 2 ranks) with the profiler on: its run dir."""
    cwd = tmp_path_factory.mktemp("profiled")
    check(launch([*DDP_RUN, *PROFILED], cwd, nproc=2))
    (run_dir,) = run_dirs(cwd)
    return run_dir


def _trace_names(path) -> set[str]:
    with gzip.open(path, "rt") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


def test_each_rank_writes_one_trace_with_the_phases_and_step_markers(profiled_run):
    traces = sorted(path.name for path in (profiled_run / "profiler").iterdir())
    assert traces == ["rank0_step11.json.gz", "rank1_step11.json.gz"]
    for name in traces:
        names = _trace_names(profiled_run / "profiler" / name)
        assert PHASES <= names, (name, PHASES - names)
        assert {"ProfilerStep#8", "ProfilerStep#9", "ProfilerStep#10"} <= names, name


def test_rank_zero_logs_the_key_averages_table(profiled_run):
    rank0, rank1 = ((profiled_run / f"train_rank{rank}.log").read_text() for rank in (0, 1))
    assert "key averages" in rank0 and "# of Calls" in rank0 and "Self CPU time total" in rank0, rank0[-3000:]
    assert "Self CPU time total" not in rank1


def test_profiling_leaves_the_training_unchanged(profiled_run, one_node):
    """The same final weights as ddp_run, unprofiled (the extra save at step 10 changes no weight)."""
    assert_same_weights(final_weights(profiled_run), one_node)


def test_memory_history_is_refused_without_cuda(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process(["profiler.memory_history=true"], tmp_path / "run")
    assert "profiler.memory_history=true" in line and "no CUDA device" in line
    result = launch(["profiler.memory_history=true", "profiler.memory_snapshot_step=5"], tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "profiler.memory_history=true" in lines[0], result.stderr
    outputs = tmp_path / "outputs"  # the refused launch removed the run dir it made
    assert not [path for path in outputs.iterdir() if path.name != ".launches"] if outputs.exists() else True


@pytest.mark.parametrize("override, message", [
    ("profiler.active=0", "profiler.active=0: must be >= 1"),
    ("profiler.wait=-1", "profiler.wait=-1: must be >= 0"),
    ("profiler.warmup=-2", "profiler.warmup=-2: must be >= 0"),
    ("profiler.table_rows=-1", "profiler.table_rows=-1: must be >= 0"),
    ("profiler.memory_snapshot_step=0", "profiler.memory_snapshot_step=0: must be a global step >= 1"),
    ("profiler.memory_snapshot_step=5", "add profiler.memory_history=true"),
])
def test_bad_settings_are_refused_in_one_line(override, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in config_error_in_this_process(["profiler.enabled=true", override], tmp_path / "run")
