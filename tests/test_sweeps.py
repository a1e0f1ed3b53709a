"""Hydra multiruns (`-m`) with real processes (CPU, gloo): plain, self-launched DDP, under torchrun,
with failing jobs, and an Optuna search; the sweep dir layout and its summary.csv / summary.md.

Every launch costs seconds of start-up, so runs that several tests read are fixtures shared by the
test processes (conftest.shared_run):
- one Optuna search over self-launched DDP trials, minimising val_loss, stands for the sweep of
  self-launched DDP (its jobs' dirs, logs, global batch and summary), for Optuna over DDP trials, and
  for Optuna taking the task's objective and direction (main's return is the same with one process:
  tests/test_segmentation_runs.py runs an Optuna search in one process);
- one plain multirun holds a job with a bad override, jobs that fail in training, and a job that
  ends well: the failed jobs' summary rows and what a failed job leaves behind;
- one multirun under torchrun ends two jobs well and then fails on one rank: the ranks' shared sweep
  dir and summary, and the sweep stopping at once."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import (TRAIN, as_json, assert_no_process_group_left_at_exit, check, exit_watch, job_numbers, launch,
                      results_of, run_dirs, shared_run)
from conftest import job_dir as job_dir_in

# One epoch of a narrow small_cnn on 128 tiny synthetic images: each job costs process start-up only.
SMALL = [
    "data=synthetic",
    "data.num_samples=128",
    "data.num_val_samples=37",
    "data.image_size=8",
    "model.channels=[8,16]",
    "trainer.max_epochs=1",
]
BATCH_SIZES = (16, 32)
SWEEP_BATCH = f"data.batch_size={','.join(map(str, BATCH_SIZES))}"
# results.json keys that summary.csv copies, exactly (csv writes floats with repr), with the default
# objective (val_accuracy); with task.objective=val_loss, that is among them already.
SUMMARY_METRICS = ("world_size", "global_batch_size", "val_loss", "val_accuracy", "samples_per_s", "wall_s")
VAL_LOSS_SUMMARY_METRICS = ("world_size", "global_batch_size", "val_loss", "samples_per_s", "wall_s")
OPTUNA_REFUSAL = (
    "error: hparams_search=optuna under torchrun would run a separate study on every rank: run "
    "`python train.py -m hparams_search=optuna strategy=ddp strategy.nproc_per_node=N` instead"
)


def output(result) -> str:
    return result.stdout + result.stderr


def the_sweep_dir(cwd: Path) -> Path:
    sweep_dirs = [p for p in (cwd / "outputs" / "multirun").iterdir() if p.is_dir()]
    assert len(sweep_dirs) == 1, sweep_dirs
    return sweep_dirs[0]


def job_dirs(sweep_dir: Path) -> list[Path]:
    return [job_dir_in(sweep_dir, job) for job in job_numbers(sweep_dir)]


def summary_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def session_hparams(job_dir: Path) -> dict:
    """The hparams of the run's HParams session, read from the events files directly in job_dir."""
    events = EventAccumulator(str(job_dir))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    return {key: value.number_value if value.HasField("number_value") else value.string_value
            for key, value in start.hparams.items()}


def rank_log_line(job_dir: Path, rank: int) -> dict:
    """The run-start line of one rank's log: strategy=ddp world_size=2 ... batch_size=B accumulate=A global_batch=G lr=L."""
    text = (job_dir / f"train_rank{rank}.log").read_text()
    (match,) = re.finditer(r"\[rank (\d+)\]\[train\]\[INFO\] strategy=(\S+) world_size=(\d+) device=\S+ "
                           r"batch_size=(\d+) accumulate=1 global_batch=(\d+) lr=(\S+) ", text)
    logged_rank, strategy, world_size, batch_size, global_batch, lr = match.groups()
    assert int(logged_rank) == rank
    return {"strategy": strategy, "world_size": int(world_size), "batch_size": int(batch_size),
            "global_batch": int(global_batch), "lr": float(lr)}


def swept_batch_sizes(rows: list[dict]) -> list[int]:
    """Each row's data.batch_size, as its overrides set it (an Optuna search samples them)."""
    return [int(dict(item.split("=", 1) for item in row["overrides"].split())["data.batch_size"]) for row in rows]


def assert_summary_matches_jobs(sweep_dir: Path, world_size: int, batch_sizes=BATCH_SIZES,
                                metrics=SUMMARY_METRICS, failed: int = 0) -> list[dict]:
    """One ok row per job, its batch sizes as swept, its metrics those of the job's results.json; then
    `failed` rows of failed jobs."""
    rows = summary_rows(sweep_dir)
    assert [row["job"] for row in rows] == [str(job) for job in range(len(batch_sizes) + failed)]
    assert all(row["status"].startswith("failed:") for row in rows[len(batch_sizes):]), rows
    for row, batch_size, job_dir in zip(rows[:len(batch_sizes)], batch_sizes, job_dirs(sweep_dir)[:len(batch_sizes)],
                                        strict=True):
        assert row["status"] == "ok", row
        assert f"data.batch_size={batch_size}" in row["overrides"].split()
        assert (int(row["world_size"]), int(row["batch_size"]), int(row["global_batch_size"])) == (
            world_size, batch_size, world_size * batch_size)
        results = results_of(job_dir)
        for key in metrics:
            expected = results[key]
            assert (row[key] == "" if expected is None else float(row[key]) == expected), (key, row[key], expected)
    assert sum(row["best"] == "True" for row in rows) == 1
    return rows


def assert_one_run_per_job_dir(cwd: Path, sweep_dir: Path, log_names: set[str], jobs: int = 2, failed: bool = False) -> None:
    """Each of the `jobs` job dirs holds one run: rank 0's .hydra and events file, one log per process;
    nothing else under outputs/, but for the claims in outputs/.launches of a torchrun launch that
    `failed` (kept for a torchrun restart; one that ends well removes them: tests/test_run_dirs.py)."""
    assert {p.name for p in (cwd / "outputs").iterdir()} == {"multirun", *([".launches"] if failed else [])}
    assert job_numbers(sweep_dir) == list(range(jobs))
    assert sorted(p.parent for p in cwd.rglob(".hydra")) == job_dirs(sweep_dir)
    for job_dir in job_dirs(sweep_dir):
        assert len(list(job_dir.rglob("events.out.tfevents*"))) == 1, job_dir
        assert len(list(job_dir.glob("events.out.tfevents*"))) == 1, job_dir
        assert {p.name for p in job_dir.glob("*.log")} == log_names, job_dir
        for rank in (0, 1):
            text = (job_dir / f"train_rank{rank}.log").read_text()
            assert f"[rank {rank}]" in text and f"[rank {1 - rank}]" not in text
    assert run_dirs(cwd) == job_dirs(sweep_dir)


# --- 1. plain multirun -------------------------------------------------------------------------

def shared_sweep(name: str, produce, tmp_path_factory) -> tuple[Path, Path, SimpleNamespace]:
    """produce(cwd)'s multirun, once for all test processes (shared_run): (cwd, its sweep dir, the process)."""
    cwd, result = shared_run(name, produce, tmp_path_factory)
    return cwd, the_sweep_dir(cwd), SimpleNamespace(**result)


def run_single_sweep(cwd: Path) -> dict:
    result = launch(["-m", "strategy=single", *SMALL, SWEEP_BATCH], cwd)
    check(result)
    return as_json(result)


@pytest.fixture
def single_sweep(tmp_path_factory):
    return shared_sweep("single_sweep", run_single_sweep, tmp_path_factory)


def test_single_sweep_has_a_job_dir_per_job_and_a_summary_row_per_job(single_sweep):
    cwd, sweep_dir, result = single_sweep
    assert job_numbers(sweep_dir) == [0, 1]
    for job_dir in job_dirs(sweep_dir):
        assert (job_dir / "results.json").is_file() and (job_dir / ".hydra" / "config.yaml").is_file()
    assert_summary_matches_jobs(sweep_dir, world_size=1)


def test_single_sweep_prints_its_summary(single_sweep):
    _, sweep_dir, result = single_sweep
    table = (sweep_dir / "summary.md").read_text()
    assert "| job | overrides |" in table and "\nbest: job " in table
    assert table in result.stdout
    assert result.stdout.count("sweep summary (") == 1


def test_single_sweep_jobs_each_log_their_hparams_in_the_job_dir(single_sweep):
    _, sweep_dir, _ = single_sweep
    assert [p for p in sweep_dir.rglob("events.out.tfevents*") if p.parent.parent != sweep_dir] == []
    for job_dir, batch_size in zip(job_dirs(sweep_dir), BATCH_SIZES, strict=True):
        hparams = session_hparams(job_dir)
        assert hparams["strategy"] == "single"
        assert (hparams["batch_size"], hparams["global_batch_size"], hparams["world_size"]) == (batch_size, batch_size, 1)


def test_tensorboard_names_each_sweep_run_after_its_swept_values(single_sweep):
    """The job dirs are `<job>_<swept values>`, so TensorBoard's run names (legend, HParams table) say
    which batch size each run had."""
    _, sweep_dir, _ = single_sweep
    runs = EventMultiplexer().AddRunsFromDirectory(str(sweep_dir)).Runs()
    assert set(runs) == {f"{job}_data.batch_size={batch_size}" for job, batch_size in enumerate(BATCH_SIZES)}


# --- 2. an Optuna search over self-launched DDP trials ---------------------------------------

def run_ddp_optuna_search(cwd: Path) -> dict:
    """2 trials of self-launched DDP on 2 processes, minimising val_loss (not the default objective,
    nor its direction)."""
    result = launch(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", "strategy.nproc_per_node=2",
                     "task.objective=val_loss", "task.direction=minimize", *SMALL], cwd, timeout=360)
    check(result)
    return as_json(result)


@pytest.fixture
def ddp_optuna_search(tmp_path_factory):
    return shared_sweep("ddp_optuna_search", run_ddp_optuna_search, tmp_path_factory)


def test_self_launched_ddp_sweep_one_run_per_job_with_the_global_batch(ddp_optuna_search):
    cwd, sweep_dir, result = ddp_optuna_search
    batch_sizes = swept_batch_sizes(summary_rows(sweep_dir))
    assert_summary_matches_jobs(sweep_dir, world_size=2, batch_sizes=batch_sizes, metrics=VAL_LOSS_SUMMARY_METRICS)
    assert_one_run_per_job_dir(cwd, sweep_dir, {"train_launcher.log", "train_rank0.log", "train_rank1.log"})
    for job_dir, batch_size in zip(job_dirs(sweep_dir), batch_sizes, strict=True):
        hparams = session_hparams(job_dir)
        assert (hparams["world_size"], hparams["global_batch_size"]) == (2, 2 * batch_size)
        assert "starting 2 DDP workers" in (job_dir / "train_launcher.log").read_text()
    assert (sweep_dir / "summary.md").read_text() in result.stdout


# --- 3, 4. multirun under torchrun, to a job that fails on one rank --------------------------------

def run_torchrun_sweep(cwd: Path) -> dict:
    """Under torchrun, on 2 ranks: jobs 0 and 1 (batch 16 and 32) end well; job 2 fails on rank 1 at step 2
    (fault.raise_rank; the sweep's order: the last key varies fastest), which must stop the sweep before
    job 3 and fast: a healthy rank that waited for the process group's timeout (1800 s) would hit the
    launch's timeout."""
    result = launch(["-m", "strategy=ddp", *SMALL, "fault.at_step=2", "fault.raise_rank=-1,1", SWEEP_BATCH], cwd, nproc=2,
                    timeout=300)
    return as_json(result)


@pytest.fixture
def torchrun_sweep(tmp_path_factory):
    return shared_sweep("torchrun_sweep", run_torchrun_sweep, tmp_path_factory)


def test_torchrun_sweep_ranks_share_one_sweep_dir_and_one_summary(torchrun_sweep):
    cwd, sweep_dir, result = torchrun_sweep  # the_sweep_dir: both ranks resolved the same sweep dir
    assert_summary_matches_jobs(sweep_dir, world_size=2, failed=1)
    assert_one_run_per_job_dir(cwd, sweep_dir, {"train_rank0.log", "train_rank1.log"}, jobs=3, failed=True)
    assert [p.parent for p in cwd.rglob("summary.csv")] == [sweep_dir]
    assert result.stdout.count("sweep summary (") == 1
    assert (sweep_dir / "summary.md").read_text() in result.stdout  # printed although the sweep failed


def test_torchrun_sweep_stops_fast_when_a_job_fails_on_one_rank(torchrun_sweep):
    _, sweep_dir, result = torchrun_sweep
    text = output(result)
    assert result.returncode != 0, text[-4000:]
    failures = re.findall(r"sweep job (\d+) \(([^)]*)\) failed; stopping the sweep", text)
    assert failures, text[-4000:]
    assert {job for job, _ in failures} == {"2"}
    assert all("fault.raise_rank=1" in overrides.split() for _, overrides in failures)
    assert "RuntimeError: injected fault: fault.raise_rank=1 at step 2" in text
    assert "Root Cause" in result.stderr
    assert 3 not in job_numbers(sweep_dir)  # the sweep stopped at the failing job
    failed = summary_rows(sweep_dir)[2]  # in the summary too (the jobs before it: the test above)
    assert failed["job"] == "2" and failed["status"].startswith("failed:"), failed


# --- 5. failing jobs in a plain multirun -------------------------------------------------------

def run_failing_sweep(cwd: Path) -> dict:
    """8 jobs in one process, each recorded by tests/workers/leak_probe.py at its start and end. Jobs
    0-3 have a bad override (data.batch_size=0); of jobs 4-7, job 4 diverges (optim.lr=1e6), jobs 5
    and 7 fail with an unexpected error at step 2 (fault.raise_rank), and job 6 ends well. Two
    DataLoader workers, which a failed job must not leave behind."""
    probe = cwd / "probe.jsonl"
    result = launch(["-m", "strategy=single", *SMALL, "data.num_workers=2", "data.batch_size=0,16", "optim.lr=1e6,0.05",
                     "fault.raise_rank=-1,0", "fault.at_step=2",
                     "+hydra.callbacks.leak_probe._target_=tests.workers.leak_probe.LeakProbe",
                     f"+hydra.callbacks.leak_probe.path={probe}"], cwd, timeout=360)
    return as_json(result)


@pytest.fixture
def failing_sweep(tmp_path_factory):
    return shared_sweep("failing_sweep", run_failing_sweep, tmp_path_factory)


def test_plain_sweep_runs_the_other_jobs_and_reports_the_failed_one(failing_sweep):
    _, sweep_dir, result = failing_sweep
    text = output(result)
    assert result.returncode != 0, text[-4000:]
    assert "data.batch_size=0: must be > 0" in text
    rows = summary_rows(sweep_dir)
    failed, ok = rows[0], rows[6]
    assert failed["job"] == "0" and "data.batch_size=0" in failed["overrides"].split()
    assert failed["status"].startswith("failed:") and "data.batch_size" in failed["status"], failed
    assert failed["val_accuracy"] == "" and failed["best"] == "False"
    assert ok["job"] == "6" and "data.batch_size=16" in ok["overrides"].split()
    assert ok["status"] == "ok" and ok["best"] == "True"
    assert float(ok["val_accuracy"]) == results_of(job_dir_in(sweep_dir, 6))["val_accuracy"]
    assert not (job_dir_in(sweep_dir, 0) / "results.json").exists()
    assert "sweep summary (" in result.stdout  # printed although Hydra ends the sweep with an error


def test_a_failed_job_leaves_nothing_behind_for_the_next_jobs(failing_sweep):
    """Jobs of a plain multirun share one process. After each job, failed or not, none of its modules
    or tensors is reachable, its DataLoader workers are gone and its TensorBoard writer is closed
    (tests/workers/leak_probe.py counts them at every job's start and end). Jobs 0-3 stop at their
    bad override; job 4 diverges, jobs 5 and 7 fail with an unexpected error at step 2
    (fault.raise_rank), job 6 ends well."""
    cwd, sweep_dir, result = failing_sweep
    assert result.returncode != 0, output(result)[-4000:]
    statuses = [row["status"].split(":")[:2] for row in summary_rows(sweep_dir)]
    assert statuses == [["failed", " ConfigError"]] * 4 + [
        ["failed", " Diverged"], ["failed", " RuntimeError"], ["ok"], ["failed", " RuntimeError"]], statuses
    records = [json.loads(line) for line in (cwd / "probe.jsonl").read_text().splitlines()]
    assert [(r["job"], r["when"]) for r in records] == [(job, when) for job in range(8) for when in ("start", "end")]
    for record in records:
        assert record | {"modules": 0, "tensors": 0, "loader_workers": 0, "open_event_writers": 0} == record, record


@pytest.mark.parametrize("strategy", [["strategy=single"], ["strategy=ddp", "strategy.nproc_per_node=2"]],
                         ids=["python", "self_launched_ddp"])
def test_a_jobs_startup_refusal_is_its_one_line_then_the_sweep_goes_on_to_its_summary(tmp_path, strategy):
    """`python train.py -m ... data.batch_size=0,16`: job 0 is refused at startup and says so in its one `error:`
    line, as a plain run does (not Hydra's `Error executing job` and a traceback through main); job 1 trains;
    then comes the summary, whose job 0 row gives the reason, and the sweep exits 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, str(TRAIN), "-m", *strategy, *SMALL, "data.batch_size=0,16"], cwd=tmp_path,
                            env=env | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)  # one stream: the order of the line and the summary
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-4000:]
    assert "Traceback" not in result.stdout and "Error executing job" not in result.stdout, result.stdout[-4000:]
    refusal = "error: data.batch_size=0: must be > 0 (it is per process), e.g. data.batch_size=32"
    assert [line for line in lines if line.startswith("error: ")] == [refusal], result.stdout[-4000:]
    summary_start = [i for i, line in enumerate(lines) if line.startswith("sweep summary (")]
    assert len(summary_start) == 1 and lines.index(refusal) < summary_start[0], result.stdout[-4000:]
    failed, ok = summary_rows(the_sweep_dir(tmp_path))
    assert failed["status"] == f"failed: ConfigError: {refusal.removeprefix('error: ')}", failed
    assert ok["status"] == "ok", ok


# --- 6. Optuna over self-launched DDP trials (the search of section 2) ---------------------------

def test_optuna_search_over_ddp_trials_every_rank_trains_the_sampled_values(ddp_optuna_search):
    _, sweep_dir, result = ddp_optuna_search
    rows = summary_rows(sweep_dir)
    assert [row["job"] for row in rows] == ["0", "1"]
    assert job_numbers(sweep_dir) == [0, 1]
    for row, job_dir in zip(rows, job_dirs(sweep_dir), strict=True):
        assert row["status"] == "ok", row
        rank0, rank1 = rank_log_line(job_dir, 0), rank_log_line(job_dir, 1)
        assert rank0 == rank1, (job_dir, rank0, rank1)
        assert (rank0["strategy"], rank0["world_size"]) == ("ddp", 2)
        sampled = dict(item.split("=", 1) for item in row["overrides"].split())
        assert rank0["batch_size"] == int(sampled["data.batch_size"]) == int(row["batch_size"])
        assert rank0["global_batch"] == 2 * rank0["batch_size"] == int(row["global_batch_size"])
        assert rank0["lr"] == pytest.approx(float(sampled["optim.lr"]), rel=1e-5)  # logged with %g
        assert float(row["val_loss"]) == results_of(job_dir)["val_loss"]

    (best,) = [row for row in rows if row["best"] == "True"]
    assert float(best["val_loss"]) == min(float(row["val_loss"]) for row in rows)  # the search minimises it
    best_line = f"best: job {best['job']} ("
    assert best_line in (sweep_dir / "summary.md").read_text() and best_line in result.stdout
    optuna_results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna_results["best_value"] == pytest.approx(float(best["val_loss"]), rel=1e-12)


def test_optuna_optimises_the_tasks_objective_in_its_direction(ddp_optuna_search):
    """main returns results[task.objective], and the sweeper takes task.direction: minimising val_loss,
    Optuna's best is the trial with the lowest val_loss (with the defaults it would be an accuracy, and the highest)."""
    _, sweep_dir, _ = ddp_optuna_search
    val_losses = [results_of(job_dir)["val_loss"] for job_dir in job_dirs(sweep_dir)]
    assert len(val_losses) == 2 and val_losses[0] != val_losses[1], val_losses
    optuna_results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optuna_results["best_value"] == min(val_losses)


def test_an_optuna_trial_that_fails_is_its_one_line_recorded_failed_and_the_search_goes_on(tmp_path):
    """A search over data.batch_size in {0, 16}: a trial of batch 0 is refused in its one `error:` line (no `Error
    executing job`, no traceback), Optuna records it as failed, the next trials run, the best is a trial that ran,
    and after the summary the sweep exits 1."""
    result = launch(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3", "optim.lr=choice(0.05)",
                     "data.batch_size=choice(0,16)", *SMALL], tmp_path, timeout=240)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text[-4000:]
    assert "Error executing job" not in text and "Traceback" not in text and "setup plugin" not in text, text[-4000:]
    rows = summary_rows(the_sweep_dir(tmp_path))
    failed = [row for row in rows if row["status"] != "ok"]
    assert failed and len(failed) < len(rows) == 3, rows
    refusal = "data.batch_size=0: must be > 0 (it is per process), e.g. data.batch_size=32"
    assert all(row["batch_size"] == "0" and row["status"] == f"failed: ConfigError: {refusal}" for row in failed), rows
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [f"error: {refusal}"] * len(failed)
    optuna_results = yaml.safe_load((the_sweep_dir(tmp_path) / "optimization_results.yaml").read_text())
    assert optuna_results["best_params"]["data.batch_size"] == 16, optuna_results


# --- 7. Optuna under torchrun ------------------------------------------------------------------

def test_optuna_under_torchrun_is_refused_before_training(tmp_path):
    """One rank is enough: the refusal is for any process that torchrun started (every rank says it)."""
    result = launch(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", *SMALL],
                    tmp_path, nproc=1, timeout=120)
    assert result.returncode != 0
    assert OPTUNA_REFUSAL in result.stderr, output(result)[-4000:]
    assert not (tmp_path / "outputs" / "multirun").exists()  # refused before the sweep started
    assert list(tmp_path.rglob("events.out.tfevents*")) == []
    assert list(tmp_path.rglob("results.json")) == []
    assert list(tmp_path.rglob("*.pt")) == []


# --- 8. self-launched DDP without -m -----------------------------------------------------------

def test_self_launched_ddp_single_run(tmp_path):
    result = launch(["strategy=ddp", "strategy.nproc_per_node=2", "syncbn=true", *SMALL, "data.batch_size=16"], tmp_path,
                    env=exit_watch(tmp_path))
    check(result)
    assert_no_process_group_left_at_exit(tmp_path)  # the self-launched ranks too
    (run_dir,) = run_dirs(tmp_path)
    assert not (tmp_path / "outputs" / "multirun").exists()
    assert [p.parent for p in tmp_path.rglob(".hydra")] == [run_dir]
    assert {p.name for p in run_dir.glob("*.log")} == {"train_launcher.log", "train_rank0.log", "train_rank1.log"}
    assert [p.parent for p in tmp_path.rglob("events.out.tfevents*")] == [run_dir]
    results = results_of(run_dir)
    assert (results["strategy"], results["world_size"], results["global_batch_size"]) == ("ddp", 2, 32)
    assert results["replicas_identical"] is True
    assert rank_log_line(run_dir, 0) == rank_log_line(run_dir, 1)
