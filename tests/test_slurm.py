"""SLURM itself: a one-node cluster on this machine (scripts/slurm/local-cluster.sh) runs
scripts/slurm/ddp.sbatch and hydra/launcher=slurm for real. Jobs are submitted with sbatch, signalled
with scancel, requeued by SLURM and resumed, or cancelled. Every training job runs conftest's DDP_RUN
and must end with the weights of torchrun 1 x 2 (one_node), and logs to every logger: each run dir's
attempts must make one MLflow run and one W&B run.

A training job costs seconds of start-up per attempt, so the sbatch script's two stories share one
run dir: a job cancelled, then submitted again (resume=auto), and that job warned of its time
limit (USR1), requeued, and finished. The sweep with a requeued job and a failing one is one run too,
shared by the test processes (conftest.shared_run).

`make test` installs and starts the cluster where it can (scripts/test-setup.sh). Where SLURM isn't
installed or the cluster isn't running, the module skips naming that script, unless
HYDRA_DDP_REQUIRE_SLURM=1 (as CI sets it) makes that a failure (tests/machine.py). On a machine with a
SLURM of its own, the jobs go to the partition HYDRA_DDP_SLURM_PARTITION names, and without it the
module skips: that SLURM gets no jobs unasked."""

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (DDP_RUN, REPO, TRAIN, assert_same_weights, final_weights, free_port_outside_the_ephemeral_range,
                      shared_run)
from machine import LOCAL_CLUSTER, SEARCH_PATH, SLURM_PARTITION, need_slurm, own_slurm
from tracker_records import (float32, mlflow_client, mlflow_runs, mlflow_runs_of, tensorboard_scalars, wandb_history,
                             wandb_records)

SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "ddp.sbatch"

# Rank 1 takes 200 ms longer per step (3.2 s of training, which this doesn't change otherwise): a
# signal sent once training has started arrives before it ends (it took under a second on a loaded
# 2-core machine).
SLOWER = ["fault.slow_rank=1", "fault.slow_ms=200"]
# 1 s longer per step (16 s of training; a sleep, no CPU): a job that resumes part-way still trains
# for seconds, long enough for a second signal to arrive.
SLOWEST = ["fault.slow_rank=1", "fault.slow_ms=1000"]
TRAINING_STARTED = "strategy=ddp world_size=2"  # rank 0's first line once SIGTERM stops it with a checkpoint


def trackers(cwd: Path) -> list[str]:
    """Every logger, MLflow's store in `cwd` (a job submitted from the repo root would put it there)."""
    return ["logger=[tensorboard,mlflow,wandb]", f"logger.mlflow.tracking_uri=sqlite:///{cwd / 'mlflow.db'}"]


# The partition the jobs go to: the cluster's default one, or HYDRA_DDP_SLURM_PARTITION's.
PARTITION = [f"--partition={SLURM_PARTITION}"] if SLURM_PARTITION else []


@pytest.fixture(scope="session", autouse=True)  # session: before the session's reference run
def cluster() -> None:
    """A SLURM to submit to (tests/machine.py), or the module skips."""
    need_slurm()


def job_env(**variables: str) -> dict[str, str]:
    """What a submitted job inherits (sbatch exports the submitter's environment): the venv's commands
    first, and one thread per rank, as torchrun sets for several processes per node (the reference's
    reductions)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PATH": os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH]), "PYTHONUNBUFFERED": "1",
                  "OMP_NUM_THREADS": "1"} | variables


def job_info(job_id: str) -> dict[str, str]:
    """SLURM's record of a job (`scontrol show job`): JobState, Reason, Restarts, ExitCode, ..."""
    shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for(condition, what: str, timeout_s: float = 300, alive=lambda: True):
    """Polls `condition` until it returns something true, which this returns."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert alive(), f"ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.1)
    return result


def log_says(path_pattern: str, text: str, root: Path):
    return lambda: any(text in path.read_text() for path in root.glob(path_pattern))


ACTIVE = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING")


def release_requeued(job_id: str) -> dict[str, str]:
    """Waits until SLURM has requeued the job, then lets it start now instead of after the begin time
    that SLURM gives a requeued job (about two minutes)."""
    def requeued() -> dict[str, str] | None:
        info = job_info(job_id)
        assert info["JobState"] in ACTIVE, f"job {job_id} ended without a requeue: {info['JobState']} {info['ExitCode']}"
        # the scheduler gives the requeued job its reason (the begin time) on its next pass, not at once
        return info if info["Restarts"] != "0" and info["JobState"] == "PENDING" and info["Reason"] != "None" else None

    info = wait_for(requeued, f"requeue of job {job_id}")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    return info


def ended(job_id: str) -> dict[str, str]:
    return wait_for(lambda: (info := job_info(job_id))["JobState"] not in ACTIVE and info, f"end of job {job_id}")


def sbatch(run_dir: Path, log_dir: Path, overrides: list[str]) -> str:
    """Submits scripts/slurm/ddp.sbatch on one node with 2 processes (no GPUs) from the repo root;
    returns the job id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *PARTITION, "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1",
         f"--output={log_dir}/slurm-%j.out", str(SBATCH_SCRIPT), *DDP_RUN[1:], *overrides],  # the script sets strategy=ddp
        cwd=REPO, env=job_env(NPROC_PER_NODE="2", RUN_DIR=str(run_dir), RDZV_PORT=str(free_port_outside_the_ephemeral_range())),
        capture_output=True, text=True, check=True)
    return submitted.stdout.strip()


def stop_line(rank0_log: str, signal_name: str) -> tuple[str, int]:
    """Rank 0's line on the stop that saved, and its step."""
    lines = [line for line in rank0_log.splitlines() if f"stopped by {signal_name} at step" in line]
    assert len(lines) == 1, f"not one 'stopped by {signal_name}' line in rank 0's log:\n{rank0_log[-4000:]}"
    return lines[0], int(lines[0].split("at step ")[1].split()[0])


def test_the_node_has_the_cpus_slurmd_finds_whatever_omp_num_threads():
    """With OMP_NUM_THREADS=1 exported (as this suite and many CPU boxes do), GNU nproc says 1: a node
    sized by it never runs a job that asks for 2 CPUs (Reason=PartitionConfig). The node must have the
    CPUs slurmd itself finds. `config` prints what `start` writes, without touching the running cluster."""
    if own_slurm():
        pytest.skip("the node config of scripts/slurm/local-cluster.sh's cluster, and this machine's SLURM is its own")
    env = os.environ | {"OMP_NUM_THREADS": "1", "PATH": SEARCH_PATH}
    written = subprocess.run([LOCAL_CLUSTER, "config"], env=env, capture_output=True, text=True, check=True).stdout
    found = subprocess.run(["slurmd", "-C"], env=env, capture_output=True, text=True, check=True).stdout
    cpus = re.findall(r"\bCPUs=(\d+)", written)
    assert cpus == re.findall(r"\bCPUs=(\d+)", found)[:1], (written, found)


# --- scripts/slurm/ddp.sbatch -----------------------------------------------------------------------


def cancel_then_requeue(cwd: Path) -> dict:
    """A job cancelled once training has started (scancel: SIGTERM to every rank, which saves); the
    same sbatch again with the same run dir (the script's resume=auto), warned of its time limit
    (--signal=B:USR1) once its resumed training has started: the batch script's trap requeues it,
    SLURM's SIGTERM makes every rank save, and the requeued job resumes and finishes."""
    run_dir = cwd / "run"
    rank0_log = run_dir / "train_rank0.log"
    first = sbatch(run_dir, cwd, [*SLOWEST, *trackers(cwd)])
    wait_for(log_says("train_rank0.log", TRAINING_STARTED, run_dir), "training", alive=lambda: job_info(first)["JobState"] in ACTIVE)
    subprocess.run(["scancel", first], check=True)
    cancelled = ended(first)
    rank0_when_cancelled, results_when_cancelled = rank0_log.read_text(), (run_dir / "results.json").exists()

    second = sbatch(run_dir, cwd, [*SLOWEST, *trackers(cwd)])
    wait_for(lambda: rank0_log.read_text().count(TRAINING_STARTED) >= 2, "training of the second job",
             alive=lambda: job_info(second)["JobState"] in ACTIVE)
    subprocess.run(["scancel", "--batch", "--signal=USR1", second], check=True)
    release_requeued(second)
    return {"first": first, "cancelled": cancelled, "rank0_when_cancelled": rank0_when_cancelled,
            "results_when_cancelled": results_when_cancelled, "second": second, "finished": ended(second)}


@pytest.fixture
def sbatch_jobs(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The dir of the jobs' output files, their run dir, and what cancel_then_requeue saw."""
    cwd, jobs = shared_run("sbatch_jobs", cancel_then_requeue, tmp_path_factory)
    return cwd, cwd / "run", jobs


def test_a_cancelled_job_leaves_a_checkpoint_that_resume_auto_continues(one_node, sbatch_jobs):
    """scancel: SIGTERM to every rank, which saves; the job is over. Submitted again with the same run
    dir, the script's resume=auto continues from that checkpoint and ends as if never stopped."""
    out_dir, run_dir, jobs = sbatch_jobs
    assert jobs["cancelled"]["JobState"] == "CANCELLED"
    _, step = stop_line(jobs["rank0_when_cancelled"], "SIGTERM")
    assert 0 < step < 16 and not jobs["results_when_cancelled"]

    info = jobs["finished"]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (out_dir / f"slurm-{jobs['second']}.out").read_text()[-6000:]
    rank0 = (run_dir / "train_rank0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at epoch {step // 8}, batch {step % 8}, step {step}" in rank0
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 16
    assert_same_weights(final_weights(run_dir), one_node)


def test_the_sbatch_script_requeues_itself_on_usr1_and_resumes_bit_identically(one_node, sbatch_jobs):
    """SLURM's warning before the time limit (--signal=B:USR1) reaches the batch script, whose trap
    requeues the job; SLURM's SIGTERM then reaches every rank, which saves; the requeued job (same id,
    same run dir) resumes and ends as if never stopped. (The job itself resumed the cancelled one's
    checkpoint: its own stop comes later.)"""
    out_dir, run_dir, jobs = sbatch_jobs
    job_id, info = jobs["second"], jobs["finished"]
    output = (out_dir / f"slurm-{job_id}.out").read_text()  # both runs (--open-mode=append)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), output[-6000:]
    assert f"time limit near: requeueing job {job_id}" in output
    rank0 = (run_dir / "train_rank0.log").read_text()
    _, cancelled_at = stop_line(jobs["rank0_when_cancelled"], "SIGTERM")
    _, step = stop_line(rank0.removeprefix(jobs["rank0_when_cancelled"]), "SIGTERM")
    assert cancelled_at < step < 16
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at epoch {step // 8}, batch {step % 8}, step {step}" in rank0
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 16
    assert_same_weights(final_weights(run_dir), one_node)


def assert_one_tracker_run(run_dir: Path, store: Path, attempts: int) -> None:
    """The run dir's attempts (a job resubmitted, requeued) continued one MLflow run and one W&B run,
    each with TensorBoard's training losses, every step once."""
    losses = tensorboard_scalars(run_dir)["train/loss"]
    assert sorted(losses) == list(range(2, 17, 2))
    (run,) = mlflow_runs_of(store, run_dir)
    history = mlflow_client(store).get_metric_history(run.info.run_id, "train/loss")
    assert run.info.status == "FINISHED" and sorted(m.step for m in history) == sorted(losses)
    assert {m.step: float32(m.value) for m in history} == losses
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == attempts
    ids, wandb_scalars, steps = wandb_history(run_dir)
    assert ids == {json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]}
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    assert {step: float32(value) for step, value in wandb_scalars["train/loss"].items()} == losses


def test_the_sbatch_scripts_three_jobs_are_one_tracker_run(sbatch_jobs):
    """The cancelled job, its resubmission and that one's requeue: one run in MLflow and one in W&B."""
    out_dir, run_dir, _ = sbatch_jobs
    assert_one_tracker_run(run_dir, out_dir / "mlflow.db", attempts=3)


# --- hydra/launcher=slurm ---------------------------------------------------------------------------

# One SLURM task per rank, 2 on the node, one CPU each.
SLURM_LAUNCHER = ["-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=2",
                  "hydra.launcher.cpus_per_task=1",
                  *([f"hydra.launcher.partition={SLURM_PARTITION}"] if SLURM_PARTITION else [])]
# Job 0 trains DDP_RUN; job 1 has a bad override.
SWEEP = [arg for arg in DDP_RUN if not arg.startswith("data.batch_size=")] + ["data.batch_size=8,0"]
BAD_BATCH = "error: data.batch_size=0: must be > 0 (it is per process), e.g. data.batch_size=32"


def run_sweep_with_a_requeue(cwd: Path) -> dict:
    """The 2-job sweep; job 0 gets submitit's requeue signal (USR2) once training has started."""
    sweep = subprocess.Popen([sys.executable, str(TRAIN), *SLURM_LAUNCHER, *SWEEP, *SLOWER, *trackers(cwd)], cwd=cwd,
                             env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(log_says("outputs/multirun/*/0_*/train_rank0.log", TRAINING_STARTED, cwd), "training in job 0",
                 alive=lambda: sweep.poll() is None)
        (job_0,) = [p.name for p in cwd.glob("outputs/multirun/*/.submitit/*_0")]  # <array job id>_<index>
        subprocess.run(["scancel", "--signal=USR2", job_0], check=True)
        requeued = release_requeued(job_0)
        output, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    job_ids = sorted(p.name for p in cwd.glob("outputs/multirun/*/.submitit/*_*") if p.is_dir())
    return {"returncode": sweep.returncode, "output": output, "job_ids": job_ids, "requeued": requeued,
            "job_0": ended(job_0)}


@pytest.fixture
def slurm_sweep(tmp_path_factory) -> tuple[Path, dict]:
    """The sweep dir, and what run_sweep_with_a_requeue saw."""
    cwd, run = shared_run("slurm_sweep", run_sweep_with_a_requeue, tmp_path_factory)
    (sweep_dir,) = (cwd / "outputs" / "multirun").iterdir()
    return sweep_dir, run


def summary(sweep_dir: Path) -> dict[str, str]:
    """job number -> status, from the sweep's summary.csv."""
    with open(sweep_dir / "summary.csv", newline="") as f:
        return {row["job"]: row["status"] for row in csv.DictReader(f)}


def test_a_slurm_sweep_runs_its_jobs_and_a_requeued_job_resumes_bit_identically(one_node, slurm_sweep):
    """hydra/launcher=slurm submits the sweep as one job array (a job per sweep point, a task per
    rank); submitit's USR2 makes every rank save, task 0 requeues the job, and it resumes in the same
    job dir and ends as if never stopped."""
    sweep_dir, run = slurm_sweep
    array_id = run["job_ids"][0].split("_")[0]
    assert run["job_ids"] == [f"{array_id}_0", f"{array_id}_1"], run["job_ids"]
    assert run["requeued"]["Reason"] == "BeginTime"
    assert (run["job_0"]["JobState"], run["job_0"]["ExitCode"], run["job_0"]["Restarts"]) == ("COMPLETED", "0:0", "1")

    (job_dir,) = sweep_dir.glob("0_*")
    rank0 = (job_dir / "train_rank0.log").read_text()
    line, step = stop_line(rank0, "SIGUSR2")
    assert "submitit requeues the job" in line and 0 < step < 16
    assert f"resumed from {job_dir / 'checkpoints' / 'last.pt'} at epoch {step // 8}, batch {step % 8}, step {step}" in rank0
    # one task (rank 0) writes .hydra/, events (one file per attempt) and results; each task its own log
    hydra_dirs = {p.parent for p in sweep_dir.parents[2].rglob(".hydra")}  # under the sweep's working dir
    assert job_dir in hydra_dirs and all(d.parent == sweep_dir for d in hydra_dirs), hydra_dirs
    assert len(list(job_dir.glob("events.out.tfevents.*"))) == 2
    assert sorted(p.name for p in job_dir.glob("*.log")) == ["train_rank0.log", "train_rank1.log"]
    results = json.loads((job_dir / "results.json").read_text())
    assert results["steps"] == 16 and results["world_size"] == 2 and results["replicas_identical"]
    assert_same_weights(final_weights(job_dir), one_node)
    assert summary(sweep_dir)["0"] == "ok"


def test_a_slurm_job_with_a_bad_override_fails_with_its_error_in_its_log(slurm_sweep):
    """Job 1 (data.batch_size=0) fails before training, with one line in its log; the sweep ends with
    an error once its jobs are done, and its summary marks the job failed."""
    sweep_dir, run = slurm_sweep
    assert run["returncode"] != 0, run["output"][-6000:]
    assert "ConfigError: data.batch_size=0" in run["output"]
    (job_1,) = [job for job in run["job_ids"] if job.endswith("_1")]
    logs = [(sweep_dir / ".submitit" / job_1 / f"{job_1}_{task}_log.err").read_text() for task in (0, 1)]
    assert BAD_BATCH in logs[0].splitlines() and "Traceback" not in logs[0], logs[0]
    assert not [line for line in logs[1].splitlines() if line.startswith("error:")], logs[1]  # a refusal every task meets: once
    (job_dir,) = sweep_dir.glob("1_*")
    assert not (job_dir / "checkpoints").exists() and not list(job_dir.glob("events.out.tfevents.*"))
    assert summary(sweep_dir)["1"].startswith("failed")


def test_a_slurm_sweeps_requeued_job_is_one_tracker_run_in_the_sweeps_group(slurm_sweep):
    """Job 0 and its requeue: one MLflow run in the sweep's experiment and one W&B run in its group;
    job 1 failed before any tracker started."""
    sweep_dir, _ = slurm_sweep
    store = sweep_dir.parents[2] / "mlflow.db"  # the sweep's working dir
    (job_dir,) = sweep_dir.glob("0_*")
    assert_one_tracker_run(job_dir, store, attempts=2)
    (run,) = mlflow_runs(store)
    experiment = mlflow_client(store).get_experiment(run.info.experiment_id).name
    assert experiment == run.data.tags["sweep"] == str(sweep_dir.relative_to(sweep_dir.parents[2]))
    assert "data.batch_size=8" in run.data.tags["overrides"]
    groups = {record.run.run_group for path in job_dir.glob("wandb/offline-run-*/run-*.wandb")
              for record in wandb_records(path) if record.WhichOneof("record_type") == "run"}
    assert groups == {experiment}
