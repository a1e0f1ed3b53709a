"""One run dir per launch, even for launches started together, and one live run per dir: real
processes started at the same moment in one working dir."""

import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import torch
from omegaconf import OmegaConf

from conftest import DDP_RUN, REPO, TINY, TORCHRUN, TRAIN, check, job_dir, job_numbers, launch, run_dirs, run_in_this_process
from data import build_datasets
from ddp.distributed.env import DistEnv
from ddp.jobs.run_dir import _prune_dead_claims
from ddp.loading.loaders import build_val_loader
from models import build_model
from test_fault_tolerance import _clean_env, assert_same_state, last_checkpoint
from ddp.training.evaluation import evaluate
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


def test_launches_of_every_kind_started_together_get_a_complete_dir_each(tmp_path):
    """Six launches started at the same moment in one working dir: two plain runs, two torchrun launches
    (2 ranks) and two sweeps (2 jobs each): the races within each kind and between kinds, at once.
    - the four runs (two plain, two torchrun) get four dirs, each holding its own run (its seed, and
      results that its own last.pt reproduces);
    - each torchrun launch's dir holds both ranks' logs, one events file and a world_size=2 result,
      and the launches leave no claims behind;
    - the two sweeps get two complete sweep dirs."""
    plain = [sys.executable, str(TRAIN), *TINY, "trainer.max_epochs=1"]
    on_two_ranks = [str(TORCHRUN), "--nproc_per_node=2", str(TRAIN), "strategy=ddp", *TINY, "trainer.max_epochs=1"]
    sweep = [sys.executable, str(TRAIN), "-m", *TINY, "trainer.max_epochs=1", "data.batch_size=16,32"]
    seeds = {1: plain, 2: plain, 3: on_two_ranks, 4: on_two_ranks}
    for result in start_together([[*command, f"seed={seed}"] for seed, command in seeds.items()] + [sweep, sweep], tmp_path):
        check(result)

    dirs = [run_dir for run_dir in run_dirs(tmp_path) if "multirun" not in run_dir.relative_to(tmp_path).parts]
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
        ranks = sorted(p.name for p in run_dir.glob("train_rank*.log"))
        if seeds[seed] is on_two_ranks:
            assert ranks == ["train_rank0.log", "train_rank1.log"], run_dir
            assert reported["world_size"] == 2
        else:
            assert ranks == ["train_rank0.log"], run_dir
        found.add(seed)
    assert found == set(seeds)
    assert not (tmp_path / "outputs" / ".launches").exists()  # each torchrun launch removed its claims when it ended

    sweeps = sorted((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 2, sweeps
    for sweep_dir in sweeps:
        assert job_numbers(sweep_dir) == [0, 1]
        assert len((sweep_dir / "summary.csv").read_text().splitlines()) == 3  # header and two jobs
        for job in (0, 1):
            assert len(list(job_dir(sweep_dir, job).glob("events.out.tfevents*"))) == 1


def test_resume_of_a_run_that_is_still_training_is_refused_and_the_run_goes_on_untouched(tmp_path, monkeypatch):
    """A second launch with resume=<dir> stops with one line naming the live run, writes nothing;
    the first run, stopped later by SIGTERM at step S, equals an undisturbed run of S steps.
    The first run's every step takes 200 ms longer (fault.slow_rank, a sleep: it changes no number), so
    it trains a few steps, not hundreds, while the second launch starts up (CPU the undisturbed run repeats)."""
    long_run = ["strategy=single", *TINY, "model.dropout=0.3", "trainer.max_epochs=100000", "checkpoint.every_n_steps=100000"]
    with open(tmp_path / "first.log", "w") as first_output:
        first = subprocess.Popen([sys.executable, str(TRAIN), *long_run, "fault.slow_rank=0", "fault.slow_ms=200"], cwd=tmp_path,
                                 env=_clean_env(), stdout=first_output, stderr=subprocess.STDOUT)
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
    monkeypatch.chdir(undisturbed)  # the reference: train.run in this process (a launch costs seconds of start-up)
    run_in_this_process([*long_run, f"trainer.max_steps={steps}"], undisturbed / "run")
    # Weights and optimizer: a stop at an epoch's last step saves before the epoch's end (epoch e,
    # batch 16, to resume there), a max_steps stop after it (epoch e + 1, batch 0).
    stopped, reference = last_checkpoint(run_dir), last_checkpoint(undisturbed / "run")
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
    # The resume's own loader workers have no part in the takeover: it loads in the main process.
    resumed = launch([*args, "data.num_workers=0", f"resume={run_dir}"], tmp_path)
    check(resumed)
    assert "at epoch 0, batch 4, step 4" in resumed.stdout
    assert last_checkpoint(run_dir)["global_step"] == 32


def test_a_restart_of_a_days_old_run_keeps_its_dir_while_another_launch_prunes_claims(killed_and_restarted):
    """File claims (no shared store, as for gloo restarts) of a run started two days ago: rank 1 is
    killed at step 7 and rank 0 ends after it, and before torchrun restarts the workers (held: its
    agent stopped), a plain launch in the same working dir prunes the claims it can prove dead. This
    claim's agent lives: the restart resumes in its own dir from the step-5 checkpoint. (The run is
    tests/conftest.py's killed_and_restarted, which tests/test_fault_tolerance.py reads too.)"""
    run_dir, _, _ = killed_and_restarted
    assert len(run_dirs(run_dir.parent.parent)) == 2  # the restarted run's and the other launch's
    assert "at epoch 0, batch 5, step 5" in (run_dir / "train_rank0.log").read_text()
    assert last_checkpoint(run_dir)["global_step"] == 16


def test_claims_are_pruned_once_their_agent_is_gone(tmp_path, monkeypatch):
    """Claims that a process wrote under a torchrun run id: kept while that process's parent (its
    agent) lives, pruned by the next launch once the agent has ended."""
    record = "import ddp.jobs.launch_agreement as r; r.agreed('run_dir', lambda: 'outputs/x')"
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


def file_digests(directory) -> dict[str, str]:
    """Every file under `directory` (dot-files, .hydra/ and checkpoints included): its sha256."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_a_refused_resume_leaves_the_run_dir_byte_identical(ddp_run, tmp_path):
    """resume=<a small_cnn run> model=resnet18 is refused in one short line that counts the mismatched keys,
    and every file of the run dir (its .hydra/ record, .lock, logs, checkpoints) is as it was: Hydra wrote
    the refused config there before the check ran, and the refusal puts the record back. (A copy of
    conftest's ddp_run: 2 ranks launched by torchrun.)"""
    (shared_dir,) = run_dirs(ddp_run[0])
    run_dir = tmp_path / "run"
    shutil.copytree(shared_dir, run_dir)
    before = file_digests(run_dir)
    data = [arg for arg in DDP_RUN if arg.startswith(("data", "trainer"))]
    result = launch(["strategy=single", "model=resnet18", *data, f"resume={run_dir}"], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: resume: {run_dir}/checkpoints/last.pt does not fit this model"), line
    assert line.endswith("122 missing keys ['bn1.bias', 'bn1.num_batches_tracked', 'bn1.running_mean', ...], "
                         "14 unexpected keys ['features.0.weight', 'features.1.bias', 'features.1.num_batches_tracked', ...]"), line
    assert len(line) < 300 + len(str(run_dir)), line
    assert file_digests(run_dir) == before
    assert not (tmp_path / "outputs").exists()
