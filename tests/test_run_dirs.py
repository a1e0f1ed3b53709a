"""One run dir per launch, even for launches started together, and one live run per dir: real
processes started at the same moment in one working dir."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY, TORCHRUN, TRAIN, check, job_dir, job_numbers, launch, run_dirs
from data import build_datasets
from ddp.env import DistEnv
from ddp.loaders import build_val_loader
from ddp.dir_lock import lock_holder
from ddp.run_dir import _prune_dead_claims
from models import build_model
from test_fault_tolerance import _clean_env, assert_same_state, last_checkpoint
from ddp.evaluation import evaluate
from tasks.classification import ClassificationTask


def start_together(commands: list[list[str]], cwd, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Start every command at once, then wait for all of them."""
    processes = [subprocess.Popen(command, cwd=cwd, env=_clean_env() | (env or {}), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for command in commands]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in processes]


def evaluate_checkpoint(run_dir) -> dict:
    """The val metrics of the run's last.pt, evaluated here in one process."""
    checkpoint = last_checkpoint(run_dir)
    cfg = OmegaConf.create(checkpoint["config"])
    splits = build_datasets(cfg.data)
    model = build_model(cfg.model, splits.num_classes, splits.in_channels)
    model.load_state_dict(checkpoint["model"], strict=True)
    return evaluate(model, build_val_loader(splits.val, cfg.data, DistEnv(), pin_memory=False), torch.device("cpu"), -1, ClassificationTask())


def test_four_runs_started_together_get_four_dirs_each_holding_its_own_run(tmp_path):
    seeds = (1, 2, 3, 4)
    results = start_together([[sys.executable, str(TRAIN), *TINY, "trainer.max_epochs=1", f"seed={seed}"] for seed in seeds],
                             tmp_path)
    for result in results:
        check(result)
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 4, dirs
    found = set()
    for run_dir in dirs:
        assert len(list(run_dir.glob("events.out.tfevents*"))) == 1, run_dir
        seed = OmegaConf.load(run_dir / ".hydra" / "config.yaml").seed
        assert last_checkpoint(run_dir)["config"]["seed"] == seed
        reported = json.loads((run_dir / "results.json").read_text())
        recomputed = evaluate_checkpoint(run_dir)
        assert (recomputed["val_accuracy"], recomputed["val_samples"]) == (reported["val_accuracy"], reported["val_samples"])
        assert abs(recomputed["val_loss"] - reported["val_loss"]) <= 1e-6 * reported["val_loss"]
        found.add(seed)
    assert found == set(seeds)


def test_two_torchrun_launches_started_together_get_two_complete_dirs(tmp_path):
    command = [str(TORCHRUN), "--nproc_per_node=2", str(TRAIN), "strategy=ddp", *TINY, "trainer.max_epochs=1"]
    for result in start_together([command, command], tmp_path):
        check(result)
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2, dirs
    for run_dir in dirs:
        assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
        assert len(list(run_dir.glob("events.out.tfevents*"))) == 1
        assert json.loads((run_dir / "results.json").read_text())["world_size"] == 2
    assert not (tmp_path / "outputs" / ".launches").exists()  # each launch removed its claims when it ended


def test_two_sweeps_started_together_get_two_complete_sweep_dirs(tmp_path):
    command = [sys.executable, str(TRAIN), "-m", *TINY, "trainer.max_epochs=1", "data.batch_size=16,32"]
    for result in start_together([command, command], tmp_path):
        check(result)
    sweeps = sorted((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 2, sweeps
    for sweep in sweeps:
        assert job_numbers(sweep) == [0, 1]
        assert len((sweep / "summary.csv").read_text().splitlines()) == 3  # header and two jobs
        for job in (0, 1):
            assert len(list(job_dir(sweep, job).glob("events.out.tfevents*"))) == 1


def test_resume_of_a_run_that_is_still_training_is_refused_and_the_run_goes_on_untouched(tmp_path):
    """A second launch with resume=<dir> stops with one line naming the live run, writes nothing;
    the first run, stopped later by SIGTERM at step S, equals an undisturbed run of S steps."""
    long_run = ["strategy=single", *TINY, "model.dropout=0.3", "trainer.max_epochs=100000", "checkpoint.every_n_steps=100000"]
    with open(tmp_path / "first.log", "w") as first_output:
        first = subprocess.Popen([sys.executable, str(TRAIN), *long_run], cwd=tmp_path, env=_clean_env(),
                                 stdout=first_output, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while not (run_dirs(tmp_path) and "global_batch=" in (run_dirs(tmp_path)[0] / "train_rank0.log").read_text()):
                assert first.poll() is None and time.monotonic() < deadline, "training never started"
                time.sleep(0.1)
            (run_dir,) = run_dirs(tmp_path)
            overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()

            second = launch([*long_run, f"resume={run_dir}"], tmp_path)
            assert second.returncode == 1, second.stdout + second.stderr
            (line,) = second.stderr.strip().splitlines()
            assert re.fullmatch(rf"error: {re.escape(str(run_dir))} is in use by a live run \(pid {first.pid} on host \S+, "
                                r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): .*", line), line
            assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides
            assert first.poll() is None, "the first run died"
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=60) == 143
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    steps = last_checkpoint(run_dir)["global_step"]
    undisturbed = tmp_path / "undisturbed"
    undisturbed.mkdir()
    check(launch([*long_run, f"trainer.max_steps={steps}"], undisturbed))
    # Weights and optimizer: a stop at an epoch's last step saves before the epoch's end (epoch e,
    # batch 16, to resume there), a max_steps stop after it (epoch e + 1, batch 0).
    stopped, reference = last_checkpoint(run_dir), last_checkpoint(run_dirs(undisturbed)[0])
    assert_same_state({k: stopped[k] for k in ("model", "optimizer")}, {k: reference[k] for k in ("model", "optimizer")})


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    """SIGKILL at step 5 while its DataLoader workers live on for a few seconds (until they notice):
    resume=<dir> right after the run's own process is gone takes the dir over and finishes the run."""
    args = ["strategy=single", *TINY, "data.num_workers=2", "checkpoint.every_n_steps=2"]
    with open(tmp_path / "killed.log", "w") as killed_output:  # a file: its workers keep no pipe open for us to wait on
        killed = subprocess.Popen([sys.executable, str(TRAIN), *args, "fault.kill_rank=0", "fault.at_step=5"], cwd=tmp_path,
                                  env=_clean_env(), stdout=killed_output, stderr=subprocess.STDOUT)
        assert killed.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    (run_dir,) = run_dirs(tmp_path)
    resumed = launch([*args, f"resume={run_dir}"], tmp_path)
    check(resumed)
    assert "at epoch 0, batch 4, step 4" in resumed.stdout
    assert last_checkpoint(run_dir)["global_step"] == 32


def test_a_restart_of_a_days_old_run_keeps_its_dir_while_another_launch_prunes_claims(tmp_path):
    """File claims (no shared store, as for gloo restarts) of a run started two days ago: rank 0 is
    killed at step 5, and before torchrun restarts the workers (held here: its agent stopped), a plain
    launch in the same working dir prunes the claims it can prove dead. This claim's agent lives: the
    restart resumes in its own dir from the step-4 checkpoint."""
    args = ["strategy=ddp", *TINY, "checkpoint.every_n_steps=2", "fault.kill_rank=0", "fault.at_step=5"]
    with open(tmp_path / "torchrun.log", "w") as output:
        agent = subprocess.Popen([str(TORCHRUN), "--nproc_per_node=2", "--max-restarts=1", str(TRAIN), *args], cwd=tmp_path,
                                 env=_clean_env(), stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (claims := list(tmp_path.glob("outputs/.launches/*/run_dir"))):
            assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.02)
        agent.send_signal(signal.SIGSTOP)  # no restart until SIGCONT
        (claim,) = claims
        while not claim.read_text():
            assert time.monotonic() < deadline, "the claim stayed empty"
            time.sleep(0.02)
        run_dir = tmp_path / claim.read_text()
        while not (list(run_dir.glob("checkpoints/step-*.pt")) and lock_holder(run_dir) is None):  # rank 0 saved, then died
            assert time.monotonic() < deadline, "rank 0 was not killed"
            time.sleep(0.02)
        two_days_ago = time.time() - 2 * 24 * 3600
        os.utime(claim.parent, (two_days_ago, two_days_ago))
        check(launch([*TINY, "trainer.max_steps=1"], tmp_path))  # prunes dead claims
        agent.send_signal(signal.SIGCONT)
        assert agent.wait(timeout=180) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGCONT)
            agent.kill()
            agent.wait()
    assert len(run_dirs(tmp_path)) == 2  # the restarted run's and the other launch's
    assert "at epoch 0, batch 4, step 4" in (run_dir / "train_rank0.log").read_text()
    assert last_checkpoint(run_dir)["global_step"] == 16


def test_claims_are_pruned_once_their_agent_is_gone(tmp_path, monkeypatch):
    """Claims that a process wrote under a torchrun run id: kept while that process's parent (its
    agent) lives, pruned by the next launch once the agent has ended."""
    record = "import ddp.launch_agreement as r; r.agreed('run_dir', lambda: 'outputs/x')"
    env = {k: v for k, v in _clean_env().items() if k != "TORCHELASTIC_USE_AGENT_STORE"} | {"PYTHONPATH": str(REPO)}
    live = subprocess.run([sys.executable, "-c", record], cwd=tmp_path, env=env | {"TORCHELASTIC_RUN_ID": "live"})
    # the shell is the agent here, and it ends right after (`; true` keeps it from exec-ing python)
    dead = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{record}"; true'], cwd=tmp_path,
                          env=env | {"TORCHELASTIC_RUN_ID": "dead"})
    assert live.returncode == dead.returncode == 0
    claims = tmp_path / "outputs" / ".launches"
    assert sorted(p.name for p in claims.iterdir()) == ["dead", "live"]
    monkeypatch.chdir(tmp_path)
    _prune_dead_claims()
    assert sorted(p.name for p in claims.iterdir()) == ["live"]
