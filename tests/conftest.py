"""Helpers for tests that run train.py for real: as `python` or under `torchrun`, in a tmp dir."""

import os

# The suite is CPU and gloo on any host: no test, and no process it starts, sees a GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Two test processes share the machine's cores: each computes on one thread, and so does every process
# it starts, as torchrun's workers do. More threads only contend (a tiny run took 20% longer with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import fcntl  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from ddp.loading.loader_workers import start_fork_server  # noqa: E402
from machine import NOT_HERE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

# A tiny but real run: synthetic data, a narrow small_cnn, two epochs.
TINY = [
    "data=synthetic",
    "data.num_samples=128",
    "data.num_val_samples=37",
    "data.image_size=8",
    "data.batch_size=8",
    "model.channels=[8,16]",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=2",
]


@pytest.fixture(scope="session", autouse=True)
def loader_fork_server() -> None:
    """The DataLoader workers of this test process all come from one fork server, which imports the
    modules of the first loader's dataset (ddp/loading/loader_workers.py). A rank has one dataset; this process
    has many, and a worker whose dataset's modules the server lacks imports them itself, torchvision
    included, seconds for each worker of each loader. So the server starts first, with them all."""
    datasets = [f"data.{path.stem}" for path in (REPO / "data").glob("*.py")] + ["ids_and_noise"]
    start_fork_server(["torch", "train", *datasets])


def launch(args: list[str], cwd: Path, nproc: int | None = None, env: dict | None = None, timeout: float = 180,
           script: Path = TRAIN):
    """Run train.py (or `script`) with `args` in `cwd` (so outputs/ lands there); under torchrun when nproc is given."""
    if nproc is None:
        command = [sys.executable, str(script), *args]
    else:
        command = [str(TORCHRUN), f"--nproc_per_node={nproc}", str(script), *args]
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # As in the Makefile: gloo re-initialises reliably after torchrun restarts only without the shared store.
    defaults = {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(
        command, cwd=cwd, env=clean | defaults | (env or {}),
        capture_output=True, text=True, timeout=timeout,
    )


def _composed(overrides: list[str]):
    """The config that train.py's `overrides` compose, as Hydra gives it to main."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def run_in_this_process(overrides: list[str], run_dir: Path) -> dict:
    """train.run on the config `overrides` compose, with `run_dir` as its run dir (made here if new),
    in this process and its working dir; what it returns. For a single-process run whose property is
    the training's, not the launch's: a launch costs seconds of start-up (torch, dynamo, Hydra) for a
    run of a fraction of that. No console or train_rank0.log (Hydra's job logging is the launch's):
    its log records reach caplog."""
    import train

    run_dir.mkdir(parents=True, exist_ok=True)
    return train.run(_composed(overrides), run_dir, relaunch="")


def config_error_in_this_process(overrides: list[str], run_dir: Path) -> str:
    """The one line of the ConfigError that train.run raises on `overrides` in this process, before
    `run_dir`, a process group, an event file or a checkpoint exists. (The command line prints such
    an error as one `error:` line and exits 1: tests/test_bad_input.py.)"""
    import train
    from ddp.config.schema import ConfigError

    cfg = _composed(overrides)
    event_files = set(Path.cwd().rglob("events.out.tfevents*"))  # those of earlier runs, if any
    with pytest.raises(ConfigError) as error:
        train.run(cfg, run_dir, relaunch="")
    line = str(error.value)
    assert "\n" not in line, line
    assert not torch.distributed.is_initialized()
    assert not run_dir.exists()  # and so no checkpoint in it
    assert set(Path.cwd().rglob("events.out.tfevents*")) == event_files
    return line


def sigterm_when(process: subprocess.Popen, ready: Callable[[], bool], output: Callable[[], str],
                 before_signal: Callable[[], None] = lambda: None, timeout_s: float = 90) -> int:
    """Once `ready()`, SIGTERM to `process` (started in a session of its own); returns its exit code.
    Fails with `output()` if the process ends first or isn't ready within timeout_s, and on any failure
    kills its whole process group, so that no run outlives its test."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert process.poll() is None, f"the run ended before it was ready\n{output()[-6000:]}"
            assert time.monotonic() < deadline, f"not ready within {timeout_s} s\n{output()[-6000:]}"
            time.sleep(0.05)
        before_signal()
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def free_port() -> int:
    """A TCP port no one listens on now (for a rendezvous or a server started next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_outside_the_ephemeral_range() -> int:
    """A free TCP port below Linux's ephemeral range (32768 and up), for a server that starts later than
    processes which listen on ephemeral ports meanwhile (srun does): one of them could take a port
    free_port() returned, and the rendezvous would connect to it."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def check(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-6000:]}"


def run_dirs(cwd: Path) -> list[Path]:
    """Every run dir under cwd/outputs (a run dir is one that holds train_rank*.log)."""
    return sorted({log.parent for log in (cwd / "outputs").rglob("train_rank*.log")})


# 2 ranks x batch 8 with SyncBN; 128 samples, so both ranks see 8 equal batches per epoch: 16 steps.
# No best checkpoints: the checkpoints are the periodic and final ones (tests/test_best.py keeps the best).
DDP_RUN = ["strategy=ddp", "syncbn=true", *TINY, "checkpoint.keep_best=0"]


EXIT_WATCH = REPO / "tests" / "workers" / "exit_watch"


def exit_watch(cwd: Path) -> dict:
    """The env for a launch in `cwd` whose every process records its threads as its exit begins
    (workers/exit_watch/), in cwd/exit_watch."""
    (cwd / "exit_watch").mkdir(exist_ok=True)
    return {"PYTHONPATH": str(EXIT_WATCH), "WATCH_DIR": str(cwd / "exit_watch")}


def threads_at_exit(cwd: Path) -> dict[str, list[str]]:
    """Each rank's threads as its exit began, by RANK, from a launch with exit_watch's env (the fork
    server and resource tracker of its DataLoader workers inherit RANK: left out by their argv)."""
    records = [json.loads(path.read_text()) for path in (cwd / "exit_watch").glob("threads_*.json")]
    return {record["rank"]: record["threads"] for record in records
            if record["rank"] is not None and record["argv"][0] == str(TRAIN)}


def assert_no_process_group_left_at_exit(cwd: Path) -> None:
    """As each of the 2 ranks' exit began, no gloo worker thread was left (release_process_groups)."""
    threads = threads_at_exit(cwd)
    assert sorted(threads) == ["0", "1"], threads
    for rank, names in threads.items():
        assert "pt_gloo_runloop" not in names, f"rank {rank} exits with a process group alive: {names}"


def checked_launch(args: list[str], nproc: int | None = None, env: dict | None = None, script: Path = TRAIN):
    """produce for shared_run: launch in its dir, check, and keep what tests read of the process."""
    def produce(cwd: Path) -> dict:
        result = launch(args, cwd, nproc=nproc, env=env(cwd) if env else None, script=script)
        check(result)
        return as_json(result)
    return produce


def completed_process(result: dict) -> subprocess.CompletedProcess:
    """A finished process as shared_run kept it (as_json), read as the process itself."""
    return subprocess.CompletedProcess([], result["returncode"], result["stdout"], result["stderr"])


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """DDP_RUN under torchrun --nproc_per_node=2, once for all test processes (shared_run), its
    processes' threads recorded at exit (exit_watch)."""
    cwd, result = shared_run("ddp_run", checked_launch(DDP_RUN, nproc=2, env=exit_watch), tmp_path_factory)
    return cwd, completed_process(result)


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def results_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return last_checkpoint(run_dir)["model"]


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    different = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not different, different


@pytest.fixture(scope="session")
def one_node(ddp_run) -> dict[str, torch.Tensor]:
    """The final weights of ddp_run (torchrun, 1 node x 2 processes): what every other launch of
    DDP_RUN must end with."""
    (run_dir,) = run_dirs(ddp_run[0])
    return final_weights(run_dir)


@pytest.fixture(scope="session")
def plain_ddp_run(tmp_path_factory):
    """2 ranks without SyncBN, so each rank's BatchNorm statistics drift apart; train.py runs under
    tests/workers/instrumented_train.py, which records every collective and host read per step and
    each rank's final weights in watch/. Logs every 4 steps; 8 steps per epoch, 2 epochs. fp16 with
    its GradScaler, clipping and EMA are on. Rank 1 is a straggler: its every forward takes 100 ms
    longer (fault.slow_rank). Once for all test processes (shared_run)."""
    def watched(cwd: Path) -> dict:
        (cwd / "watch").mkdir()
        return {"WATCH_DIR": str(cwd / "watch")}

    args = ["strategy=ddp", *TINY, "model.dropout=0.2", "trainer.log_every_n_steps=4", "checkpoint.every_n_steps=0",
            "precision=16", "trainer.gradient_clip_norm=0.5", "ema.decay=0.9", "fault.slow_rank=1", "fault.slow_ms=100"]
    cwd, result = shared_run("plain_ddp_run", checked_launch(args, nproc=2, env=watched,
                                                             script=REPO / "tests" / "workers" / "instrumented_train.py"),
                             tmp_path_factory)
    return cwd, completed_process(result)


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Path:
    """The same training as ddp_run in one process with the global batch of 16, once for all test
    processes, by train.run in a test process: its run dir."""
    return shared_run_in_this_process("single_run", ["strategy=single", *TINY, "data.batch_size=16"], tmp_path_factory)


def write_imagefolder(root: Path, classes=("cat", "dog"), per_class: int | dict[str, int] = 3,
                      splits=("train", "val"), size=(24, 20), suffix: str = ".png") -> Path:
    """A real ImageFolder tree of small, non-square RGB PNGs (or JPEGs: suffix=".jpg"): each class its own colour,
    each image its own noise (so the classes are easy to learn). `per_class`: images per class, or per split and class."""
    rng = np.random.default_rng(0)
    for split in splits:
        count = per_class[split] if isinstance(per_class, dict) else per_class
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            colour = np.array([(90 * index) % 256, (150 * index) % 256, 200])
            for i in range(count):
                pixels = np.clip(colour + rng.integers(-30, 30, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}{suffix}")
    return root


def job_dir(sweep_dir: Path, job: int) -> Path:
    """A sweep job's dir, `<job>_<its overrides>`."""
    (found,) = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.split("_", 1)[0] == str(job)]
    return found


def job_numbers(sweep_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_", 1)[0]) for p in sweep_dir.iterdir() if p.is_dir())


def load_last(cwd):
    (run_dir,) = run_dirs(cwd)
    return last_checkpoint(run_dir)


def load_results(cwd):
    (run_dir,) = run_dirs(cwd)
    return results_of(run_dir)


def hparams_table(logdir: Path) -> dict[str, dict]:
    """TensorBoard's HParams table for `logdir` as its own backend builds it (event reader, data provider,
    hparams plugin): {run: {hparam: value}}."""
    from google.protobuf import json_format
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=str(logdir)))
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=list(api_pb2.Status.values()))
    response = list_session_groups.Handler(context.RequestContext(), backend, "", request).run()
    return {group.name: {name: json_format.MessageToDict(value) for name, value in group.hparams.items()}
            for group in response.session_groups}


# --- Runs that every test process shares, and the exact-resume references -----------------------------
# pytest-xdist runs a module- or session-scoped fixture once in each worker that needs it: with the
# tests that read a run split over both workers, an expensive run would run twice.

def shared_run(name: str, produce: Callable[[Path], object], tmp_path_factory) -> tuple[Path, object]:
    """produce(dir) once for all test processes (pytest-xdist workers), in a dir they share: the
    first to get here runs it, the others wait for it (asleep). Returns the dir and produce's result (JSON)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common parent
    cwd, result_file = base / name, base / f"{name}.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result_file.exists():
            if cwd.exists():
                pytest.fail(f"{name} failed in an earlier test: see its error")
            cwd.mkdir()
            result_file.write_text(json.dumps(produce(cwd)))
    return cwd, json.loads(result_file.read_text())


def shared_run_in_this_process(name: str, overrides: list[str], tmp_path_factory) -> Path:
    """run_in_this_process once for all test processes (shared_run), from its dir: its run dir."""
    def produce(cwd: Path) -> None:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(cwd)
            run_in_this_process(overrides, cwd / "run")

    cwd, _ = shared_run(name, produce, tmp_path_factory)
    return cwd / "run"


def as_json(result: subprocess.CompletedProcess) -> dict:
    """What tests read of a finished process, for shared_run."""
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


# Each reference is one uninterrupted run; every resumed run of the same training (whatever stopped it)
# must end bit-identical to it. fault.*, checkpoint.*, logging and trainer.max_epochs beyond the last step
# don't change the training (no LR schedule here), so runs that differ only there compare to the same one.

# Randomness everywhere a resume could get it wrong: dropout (global RNG, per rank), random
# augmentation, and a shuffled sampler.
EXACT_DATA = [*TINY, "model.dropout=0.3", "data.augment=true"]
# 2 ranks x 8 batches x 2 epochs = 16 steps, augmentation in 2 DataLoader workers per rank.
EXACT_DDP = ["strategy=ddp", *EXACT_DATA, "data.num_workers=2", "trainer.max_epochs=2", "trainer.log_every_n_steps=1",
             "checkpoint.every_n_steps=5"]
# One process, 16 steps per epoch (128 samples, batch 8), augmentation in the main process (it draws
# from the global RNG as each batch loads); its reference stops 4 steps into the second epoch.
EXACT_SINGLE = ["strategy=single", *EXACT_DATA, "data.num_workers=0", "trainer.max_epochs=3"]
EXACT_SINGLE_STEPS = 20


@pytest.fixture(scope="session")
def exact_ddp_reference(tmp_path_factory):
    """EXACT_DDP uninterrupted under torchrun --nproc_per_node=2: (run dir, its final last.pt)."""
    cwd, _ = shared_run("exact_ddp_reference", lambda cwd: check(launch(EXACT_DDP, cwd, nproc=2)), tmp_path_factory)
    (run_dir,) = run_dirs(cwd)
    checkpoint = last_checkpoint(run_dir)
    assert checkpoint["global_step"] == 16 and checkpoint["epoch"] == 2
    return run_dir, checkpoint


@pytest.fixture(scope="session")
def exact_single_reference(tmp_path_factory):
    """EXACT_SINGLE uninterrupted for EXACT_SINGLE_STEPS steps in one process (train.run in a test
    process; tests/test_interrupts.py resumes a launched run to end equal to it): (run dir, its final last.pt)."""
    run_dir = shared_run_in_this_process("exact_single_reference", [*EXACT_SINGLE, f"trainer.max_steps={EXACT_SINGLE_STEPS}"],
                                         tmp_path_factory)
    checkpoint = last_checkpoint(run_dir)
    assert checkpoint["global_step"] == EXACT_SINGLE_STEPS
    return run_dir, checkpoint


def _restartable_env() -> dict:
    """As `launch` gives its processes: no rank variables of this process, unbuffered, file claims."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return clean | {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _kill_and_restart_past_a_pruning_launch(cwd: Path) -> dict:
    """EXACT_DDP under torchrun --max-restarts=1; rank 1 is killed at step 7, after the step-5 checkpoint.
    torchrun's agent is held (SIGSTOP) once it has claimed the run dir (a file claim: no shared store,
    as for gloo restarts). When rank 0 has died too (of its lost peer), the lock is free, and before the
    restart a plain launch in the same working dir prunes the claims it can prove dead, this one made
    to look two days old: its agent lives, so it must stay. Then the agent goes on (SIGCONT) and
    restarts both ranks, which resume from the step-5 checkpoint in their own run dir.
    Returns that run dir (relative to `cwd`), torchrun's stdout and its stderr."""
    from ddp.jobs.dir_lock import lock_holder

    command = [str(TORCHRUN), "--nproc_per_node=2", "--max-restarts=1", str(TRAIN), *EXACT_DDP, "fault.kill_rank=1",
               "fault.at_step=7"]
    with open(cwd / "torchrun.out", "w") as stdout, open(cwd / "torchrun.err", "w") as stderr:
        agent = subprocess.Popen(command, cwd=cwd, env=_restartable_env(), stdout=stdout, stderr=stderr)

    def output() -> str:
        return (cwd / "torchrun.out").read_text()[-3000:] + (cwd / "torchrun.err").read_text()[-5000:]

    try:
        deadline = time.monotonic() + 180
        while not (claims := list(cwd.glob("outputs/.launches/*/run_dir"))):
            assert agent.poll() is None and time.monotonic() < deadline, output()
            time.sleep(0.02)
        agent.send_signal(signal.SIGSTOP)  # no restart until SIGCONT
        (claim,) = claims
        while not (claimed := claim.read_text()):
            assert time.monotonic() < deadline, "the claim stayed empty"
            time.sleep(0.02)
        run_dir = cwd / claimed
        while not ((run_dir / "checkpoints" / "step-00000005.pt").exists() and lock_holder(run_dir) is None):
            assert time.monotonic() < deadline, f"rank 0 did not save and end\n{output()}"
            time.sleep(0.02)
        two_days_ago = time.time() - 2 * 24 * 3600
        os.utime(claim.parent, (two_days_ago, two_days_ago))
        check(launch([*TINY, "trainer.max_steps=1"], cwd))  # prunes dead claims
        agent.send_signal(signal.SIGCONT)
        assert agent.wait(timeout=300) == 0, output()
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGCONT)
            agent.kill()
            agent.wait()
    return {"run_dir": claimed, "stdout": (cwd / "torchrun.out").read_text(),  # the claim is gone with its launch
            "stderr": (cwd / "torchrun.err").read_text()}


@pytest.fixture(scope="session")
def killed_and_restarted(tmp_path_factory):
    """_kill_and_restart_past_a_pruning_launch, once: (its run dir, torchrun's stdout, its stderr). Read by
    tests/test_fault_tolerance.py (the restart ends bit-identical) and tests/test_run_dirs.py (the
    restart keeps its dir while the other launch prunes claims)."""
    cwd, result = shared_run("killed_and_restarted", _kill_and_restart_past_a_pruning_launch, tmp_path_factory)
    return cwd / result["run_dir"], result["stdout"], result["stderr"]


# --- What didn't run here ---------------------------------------------------------------------------------

def pytest_terminal_summary(terminalreporter) -> None:
    """Last before pytest's final line: the tests skipped for a piece this machine lacks (tests/machine.py: a
    browser, SLURM), by file and piece, each with the one command that makes them run."""
    counts = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else ""
        if reason.startswith(NOT_HERE):
            counts[report.nodeid.split("::")[0], reason.removeprefix(NOT_HERE)] += 1
    if counts:
        terminalreporter.section("not run on this machine")
    for (path, reason), count in counts.items():
        terminalreporter.line(f"{count} {'test of' if count == 1 else 'tests of'} {path} "
                              f"{'needs' if count == 1 else 'need'} {reason}")
