"""Beyond one machine: the launch environments a rank recognises (torchrun, SLURM through submitit,
a plain process), two torchrun "nodes" on localhost, and a requeue by hydra-submitit-launcher's local
executor during a long validation. Jobs on a real SLURM are in test_slurm.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from conftest import DDP_RUN, REPO, TORCHRUN, TRAIN, assert_same_weights, check, final_weights, free_port, run_dirs
from ddp.config.schema import register_configs
from ddp.distributed.env import DistEnv
from ddp.jobs.run_dir import register_resolvers

# The variables of every launcher, cleared before each simulated environment.
LAUNCH_VARIABLES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR",
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES",
    "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
]

# 2 nodes x 8 GPUs; this task is the second GPU of the second node.
SLURM_TASK = {
    "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[017-018]",
}


@pytest.fixture
def environ(monkeypatch):
    """Sets a simulated launch environment (and nothing else of the launchers')."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_to(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_to


def test_every_package_of_the_repo_imports_from_the_install_alone(tmp_path):
    """A submitit job unpickles its function and config in a fresh interpreter, in the job's dir: every
    package of the repo must come from the install (`make install`), not from the repo's cwd or a PYTHONPATH."""
    packages = sorted(path.parent.name for path in REPO.glob("*/__init__.py") if path.parent.name != "tests")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", f"import {', '.join(packages)}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{packages}: {result.stderr[-2000:]}"


def test_a_plain_process_is_rank_0_of_1(environ):
    environ({})
    assert DistEnv.from_environ() == DistEnv()
    assert not DistEnv.from_environ().launched


def test_a_slurm_task_started_by_submitit_is_one_rank_per_task(environ):
    environ(SLURM_TASK)
    env = DistEnv.from_environ()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert env.master_addr == "gpu017" and env.launcher == "submitit" and env.launched
    # every task derives the same port from the job id
    environ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert DistEnv.from_environ().master_port == env.master_port and 20000 <= env.master_port <= 60000
    environ({"MASTER_PORT": "12345"})
    assert DistEnv.from_environ().master_port == 12345


def test_torchrun_inside_a_slurm_job_wins(environ):
    """`srun torchrun ...` (scripts/slurm/ddp.sbatch): torchrun's ranks, not SLURM's one task per node."""
    environ(SLURM_TASK | {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                          "MASTER_ADDR": "gpu017", "MASTER_PORT": "29400"})
    env = DistEnv.from_environ()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == (3, 3, 8, 4, "torchrun")


def test_submitit_local_executor_tasks(environ):
    environ({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "777", "SUBMITIT_LOCAL_NTASKS": "2",
             "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "1",
             "SUBMITIT_LOCAL_LOCALID": "1"})
    env = DistEnv.from_environ()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launcher) == (1, 1, 2, 2, "submitit")


def test_the_slurm_launcher_runs_one_task_per_gpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # resolving the launcher's folder claims a sweep dir
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.nodes=2",
                                           "hydra.launcher.partition=gpu"], return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    assert {key: launcher.params[key] for key in ("nodes", "gpus_per_node", "tasks_per_node", "partition")} == \
        {"nodes": 2, "gpus_per_node": 4, "tasks_per_node": 4, "partition": "gpu"}
    assert launcher.params["max_num_timeout"] > 0  # requeued after a timeout


# --- real launches: every one trains conftest's DDP_RUN, and must end with ddp_run's weights (one_node) -


def launch_env(share_store: bool = False) -> dict[str, str]:
    # One thread per rank, as torchrun sets for several processes per node: the reference's reductions.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return env | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1"}


def two_nodes(node_args: list[list[str]], cwd: Path) -> None:
    """One torchrun agent per "node", both on this host and in one working dir (a shared filesystem)."""
    env = launch_env(share_store=True)
    agents = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", "--nproc-per-node=1", *args, str(TRAIN), *DDP_RUN],
                               cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for args in node_args]
    for agent in agents:
        output, _ = agent.communicate(timeout=240)
        assert agent.returncode == 0, output[-6000:]


def test_two_nodes_with_static_rendezvous_train_as_one_node(one_node, tmp_path):
    """--master-addr/--master-port and --node-rank (as many tutorials launch, on one node too): no run
    id, but torchrun's shared store (its default) agrees on the run dir."""
    port = free_port()
    two_nodes([[f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"] for node in (0, 1)], tmp_path)
    (run_dir,) = run_dirs(tmp_path)
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
    assert_same_weights(final_weights(run_dir), one_node)


# Stand-ins for SLURM's commands, which this host lacks: srun starts its command once per node (here
# all on this host, as --ntasks-per-node=1 would), scontrol names this host as the first node.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] && echo 127.0.0.1
"""


def test_the_sbatch_script_trains_two_nodes_as_one(one_node, tmp_path):
    """scripts/slurm/ddp.sbatch: one torchrun agent per node, c10d rendezvous (endpoint and id) on the
    first host; the two-node c10d launch of docs/clusters.md."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = launch_env(share_store=True) | {
        "PATH": os.pathsep.join([str(bin_dir), str(TORCHRUN.parent), os.environ["PATH"]]),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO), "RUN_DIR": str(tmp_path / "run"), "RDZV_PORT": str(free_port()),
    }
    outputs_before = sorted((REPO / "outputs").iterdir())
    result = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "ddp.sbatch"), *DDP_RUN[1:]], env=env,
                            capture_output=True, text=True, timeout=240)
    check(result)
    assert sorted(p.name for p in (tmp_path / "run").glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
    assert_same_weights(final_weights(tmp_path / "run"), one_node)
    assert sorted((REPO / "outputs").iterdir()) == outputs_before  # everything went to RUN_DIR


SUBMITIT_LOCAL = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"]


def the_job_dir(cwd: Path) -> Path:
    (job_dir,) = [d for d in (cwd / "outputs" / "multirun").glob("*/*") if d.is_dir() and not d.name.startswith(".")]
    return job_dir


def _tasks_of(session: int) -> list[int]:
    """The submitit tasks (one per rank) among the processes of a session."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == session and \
                    b"submitit.core._submit" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue  # ended meanwhile
    return pids


def _requeued_by_usr2(args: list[str], ready, cwd: Path):
    """DDP_RUN with `args` as a 2-task submitit job: once `ready()` returns something true, USR2 to both
    tasks as SLURM sends it; the job must then be requeued and finish. Returns what `ready()` returned."""
    sweep = subprocess.Popen([sys.executable, str(TRAIN), *SUBMITIT_LOCAL, *DDP_RUN, *args], cwd=cwd, env=launch_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (found := ready()):
        assert sweep.poll() is None and time.monotonic() < deadline, f"not ready: {args}"
        time.sleep(0.02)
    tasks = _tasks_of(sweep.pid)
    assert len(tasks) == 2
    for pid in tasks:
        os.kill(pid, signal.SIGUSR2)
    output, _ = sweep.communicate(timeout=240)
    assert sweep.returncode == 0, output[-6000:]
    return found


def test_a_requeue_signal_during_a_long_validation_still_requeues_the_job(one_node, tmp_path):
    """USR2 while every rank validates for longer than trainer.stop_deadline_s (fault.slow_val_ms): no
    check step comes in time, so the ranks exit without a new checkpoint, yet submitit requeues the
    job, which resumes from its last periodic checkpoint and finishes as if never stopped."""
    slower = ["checkpoint.every_n_steps=4", "fault.slow_val_ms=800", "trainer.stop_deadline_s=0.5"]
    _requeued_by_usr2(slower, lambda: any("fault.slow_val_ms" in log.read_text()
                                          for log in tmp_path.glob("outputs/multirun/*/0_*/train_rank0.log")), tmp_path)

    job_dir = the_job_dir(tmp_path)
    rank0 = (job_dir / "train_rank0.log").read_text()
    assert "SIGUSR2: no step boundary within 0.5 s, exiting without a checkpoint; submitit requeues the job" in rank0, rank0[-3000:]
    assert "stopped by SIGUSR2" not in rank0
    assert f"resumed from {job_dir / 'checkpoints' / 'last.pt'} at epoch 0, batch 4, step 4" in rank0
    assert json.loads((job_dir / "results.json").read_text())["steps"] == 16
    assert_same_weights(final_weights(job_dir), one_node)
