"""The logger group (ddp/reporting/trackers.py): MLflow and W&B runs, read back with their own client and
file format, against TensorBoard's events as TensorBoard's reader gives them.

One working dir holds every run of this file, so one local MLflow store (outputs/mlflow.db) holds them
all, as it would for a user: a 2-rank torchrun run with all three loggers, killed at step 7 and restarted
by torchrun (--max-restarts), then continued longer with resume=<run dir> by self-launched DDP; and a
2-job sweep. `make mlflow-ui` serves that store to a real headless browser."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, TINY, TORCHRUN, TRAIN, check, config_error_in_this_process, free_port, launch, run_dirs, shared_run
from machine import BROWSER, DRIVER, need_browser
from test_bad_input import assert_no_run_dir_left
from tracker_records import float32, mlflow_client, mlflow_runs, mlflow_runs_of, tensorboard_scalars, wandb_history, wandb_records

LOGGERS = "logger=[tensorboard,mlflow,wandb]"
# 2 ranks x 8 steps per epoch; every step logged; checkpoints every 5 steps.
RUN = ["strategy=ddp", *TINY, "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=5", "checkpoint.keep_best=0", LOGGERS]
KILLED_AT, SAVED_AT, FIRST_STEPS, RESUMED_STEPS = 7, 5, 16, 24
SWEEP = ["-m", *[a for a in TINY if not a.startswith(("data.batch_size", "trainer.max_epochs"))], "trainer.max_epochs=1",
         "logger=mlflow", "data.batch_size=8,16"]
# Scalars that time the run: an attempt that repeats a step measures them anew.
TIMINGS = ("train/samples_per_s", "train/samples_per_s_per_rank", "train/epoch_time_s", "perf/")


def _offline_env() -> dict:
    """No W&B key (the tests' machines have none, nor a network): W&B runs offline, as where it was never set up."""
    assert "WANDB_API_KEY" not in os.environ and "WANDB_MODE" not in os.environ
    return {}


def _runs_of_this_file(cwd: Path) -> dict:
    """The killed-and-restarted torchrun run, then resume=<run dir> with one more epoch, then the sweep."""
    command = [str(TORCHRUN), "--nproc_per_node=2", "--max-restarts=1", str(TRAIN), *RUN, "fault.kill_rank=1",
               f"fault.at_step={KILLED_AT}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} | _offline_env()
    restarted = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    check(restarted)
    (run_dir,) = [p for p in (cwd / "outputs").iterdir() if (p / "train_rank0.log").exists()]
    resumed = launch([*RUN, "strategy.nproc_per_node=2", f"resume={run_dir}", "trainer.max_epochs=3"], cwd, env=_offline_env())
    check(resumed)
    swept = launch(SWEEP, cwd)
    check(swept)
    (sweep_dir,) = (cwd / "outputs" / "multirun").iterdir()
    return {"run_dir": str(run_dir), "sweep_dir": str(sweep_dir), "restarted_stderr": restarted.stderr,
            "resumed_output": resumed.stdout + resumed.stderr, "swept_output": swept.stdout + swept.stderr}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    cwd, result = shared_run("tracker_runs", _runs_of_this_file, tmp_path_factory)
    return result | {"cwd": cwd, "run_dir": Path(result["run_dir"]), "sweep_dir": Path(result["sweep_dir"])}


def _client(cwd: Path):
    return mlflow_client(cwd / "outputs" / "mlflow.db")


def _mlflow_runs(cwd: Path) -> list:
    return mlflow_runs(cwd / "outputs" / "mlflow.db")


def _replayed(tag: str, step: int) -> bool:
    """A timing that the restarted attempt measured again for a step the MLflow run already had."""
    return tag.startswith(TIMINGS) and SAVED_AT < step <= KILLED_AT


# --- MLflow ------------------------------------------------------------------------------------

def test_a_torchrun_run_restarted_and_resumed_is_one_mlflow_run_with_tensorboards_scalars(runs):
    """2 ranks, a kill and torchrun's restart, then resume=<run dir>: one MLflow run, whose metric history has
    every step once and equals TensorBoard's scalars step for step (a repeated step's timing excepted)."""
    (run,) = mlflow_runs_of(runs["cwd"] / "outputs" / "mlflow.db", runs["run_dir"])
    assert [r.info.run_name for r in _mlflow_runs(runs["cwd"])].count(runs["run_dir"].name) == 1
    assert run.info.status == "FINISHED"
    client = _client(runs["cwd"])
    tensorboard = tensorboard_scalars(runs["run_dir"])
    assert set(run.data.metrics) == set(tensorboard)
    for tag, by_step in tensorboard.items():
        history = client.get_metric_history(run.info.run_id, tag)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice: {sorted(steps)}"
        mlflow_values = {m.step: m.value for m in history}
        assert mlflow_values.keys() == by_step.keys(), tag
        different = {step: (mlflow_values[step], value) for step, value in by_step.items()
                     if float32(mlflow_values[step]) != value and not _replayed(tag, step)}
        assert not different, f"{tag}: {different}"
    assert sorted(tensorboard["train/loss"]) == list(range(1, RESUMED_STEPS + 1))
    assert "exitcode: -9" in runs["restarted_stderr"]  # rank 1 was killed, and torchrun restarted both


def test_the_training_does_not_wait_for_the_trackers_to_start(runs):
    """The trackers start in a process of their own: the first attempt had logged its first step to TensorBoard
    before MLflow's import and store (seconds, which the loop used to wait for) let it create the MLflow run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = mlflow_runs_of(runs["cwd"] / "outputs" / "mlflow.db", runs["run_dir"])
    events = EventAccumulator(str(runs["run_dir"]), size_guidance={"scalars": 0})
    events.Reload()
    (first_step,) = [event for event in events.Scalars("train/loss") if event.step == 1]
    assert first_step.wall_time * 1000 < run.info.start_time, (first_step.wall_time, run.info.start_time / 1000)


def test_the_mlflow_run_holds_the_config_and_hparams(runs):
    (run,) = mlflow_runs_of(runs["cwd"] / "outputs" / "mlflow.db", runs["run_dir"])
    params = run.data.params
    config = OmegaConf.load(runs["run_dir"] / ".hydra" / "config.yaml")
    assert params["optim.lr"] == str(config.optim.lr) and params["strategy.name"] == "ddp"
    assert params["model.channels"] == "[8, 16]" and params["data.batch_size"] == "8"
    assert params["world_size"] == "2" and params["global_batch_size"] == "16"  # the HParams row's
    # the resume changed its length: MLflow keeps a param's first value, the new one is a tag
    assert params["trainer.max_epochs"] == "2" and run.data.tags["changed.trainer.max_epochs"] == "3"
    assert "hparam/val_accuracy" in run.data.metrics


def test_a_sweep_is_one_mlflow_experiment_of_one_run_per_job_with_its_overrides(runs):
    client = _client(runs["cwd"])
    sweep = str(runs["sweep_dir"].relative_to(runs["cwd"]))
    experiment = client.get_experiment_by_name(sweep)
    assert experiment is not None, [e.name for e in client.search_experiments()]
    jobs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["data.batch_size"] for r in jobs) == ["16", "8"]
    for job in jobs:  # its command line's overrides, the swept value among them
        assert job.data.tags["overrides"].split() == [*SWEEP[1:-1], f"data.batch_size={job.data.params['data.batch_size']}"]
    assert {r.data.tags["sweep"] for r in jobs} == {sweep}
    assert all(r.info.status == "FINISHED" and "val/accuracy" in r.data.metrics for r in jobs)


def test_the_consoles_last_lines_say_where_each_picked_logger_keeps_the_run(runs):
    """The resumed run picked all three loggers; the sweep's jobs MLflow alone: no TensorBoard line, nor event file."""
    run_dir, state = runs["run_dir"], json.loads((runs["run_dir"] / "trackers.json").read_text())
    lines = [line.split("[INFO] ", 1)[1] for line in runs["resumed_output"].splitlines() if "[train][INFO]" in line]
    assert lines[-3:] == [f"tensorboard: tensorboard --logdir {run_dir}  (or: make tensorboard)",
                          f"mlflow: run {state['mlflow']['run_id']} in make mlflow-ui",
                          f"wandb: run {state['wandb']['id']}; upload it with: wandb sync {run_dir}/wandb/offline-run-*"]
    swept = runs["swept_output"]
    assert swept.count("in make mlflow-ui") == 2 and "tensorboard --logdir" not in swept, swept[-3000:]
    assert not list(runs["sweep_dir"].rglob("events.out.tfevents.*"))


# --- W&B, offline ----------------------------------------------------------------------------------

def test_wandb_ran_offline_as_one_run_continued_by_the_restart_and_the_resume(runs):
    run_dir = runs["run_dir"]
    attempts = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(attempts) == 3, attempts  # the first attempt, torchrun's restart, resume=<run dir>
    ids, history, steps = wandb_history(run_dir)
    assert ids == {json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]}
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    tensorboard = tensorboard_scalars(run_dir)
    assert sorted(history["train/loss"]) == list(range(1, RESUMED_STEPS + 1))
    assert history.keys() == tensorboard.keys()
    for tag, by_step in tensorboard.items():
        assert history[tag].keys() == by_step.keys(), tag
        different = {step: (history[tag][step], value) for step, value in by_step.items()
                     if float32(history[tag][step]) != value and not _replayed(tag, step)}
        assert not different, f"{tag}: {different}"


# --- make mlflow-ui, in a real browser --------------------------------------------------------------

@contextlib.contextmanager
def mlflow_server(command: list[str], port: int, log: Path):
    """An MLflow server started by `command` (in a session of its own), once its /health answers: its URL.
    Stopped, with every process it started, at the end."""
    with open(log, "w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.fixture(scope="session")  # session: checked before the module's runs
def browser() -> None:
    """chromium and its driver, which `make test` installs where it can (scripts/test-setup.sh); without them
    the test skips naming that script, or fails with HYDRA_DDP_REQUIRE_BROWSER=1 (as CI sets it)."""
    need_browser()


def test_make_mlflow_ui_serves_the_store_and_its_page_lists_the_runs(browser, runs):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    store = runs["cwd"] / "outputs" / "mlflow.db"
    make_mlflow_ui = ["make", "--no-print-directory", "-C", str(REPO), "mlflow-ui", f"MLFLOW_STORE={store}", f"MLFLOW_PORT={port}"]
    options = webdriver.ChromeOptions()
    options.binary_location = str(BROWSER)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={runs['cwd'] / 'browser-profile'}"):
        options.add_argument(flag)
    with mlflow_server(make_mlflow_ui, port, runs["cwd"] / f"mlflow-ui-{port}.log") as url:
        browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
        try:
            client = _client(runs["cwd"])
            for experiment in ("hydra-ddp", str(runs["sweep_dir"].relative_to(runs["cwd"]))):  # a run's, the sweep's
                experiment_id = client.get_experiment_by_name(experiment).experiment_id
                names = [run.info.run_name for run in client.search_runs([experiment_id])]
                browser.get(f"{url}/#/experiments/{experiment_id}/runs")  # the experiment's table of training runs
                WebDriverWait(browser, 60).until(lambda b: all(name in b.find_element("tag name", "body").text for name in names))
                assert names and (runs["run_dir"].name in names if experiment == "hydra-ddp" else len(names) == 2)
        finally:
            browser.quit()


def lines_until_the_mlflow_run(training: subprocess.Popen) -> list[str]:
    """The training's output lines up to the one that says its MLflow run exists."""
    output = []
    for line in training.stdout:
        output.append(line)
        if "mlflow: run " in line:
            break
    return output


def test_mlflow_runs_outside_the_training_process_and_a_ctrl_c_still_ends_its_run_with_every_step(tmp_path):
    """The trackers run in a process of their own (ddp/reporting/tracker_process.py): the training's never imports
    MLflow. A terminal's Ctrl-C, which goes to the whole process group, stops the training at a step boundary
    with a checkpoint; the tracker process, in a session of its own, still gets the last steps and ends the run."""
    overrides = [*TINY, "trainer.max_epochs=10", "fault.slow_rank=0", "fault.slow_ms=150", "trainer.log_every_n_steps=1",
                 "logger=[tensorboard,mlflow]"]  # 160 steps of 150 ms: the training outlasts MLflow's start on a busy machine
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('mlflow imported by the training:', 'mlflow' in sys.modules, flush=True))\n"
            f"sys.argv = {[str(TRAIN), *overrides]!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    training = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    output = lines_until_the_mlflow_run(training)  # the run exists, so its store has its tables: this test's client may read it
    store = tmp_path / "outputs" / "mlflow.db"
    while not any("train/loss" in run.data.metrics for run in mlflow_runs(store)):
        assert training.poll() is None, "".join(output)
        time.sleep(0.2)
    os.killpg(training.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the foreground group
    rest, _ = training.communicate(timeout=120)
    output = "".join(output) + rest
    assert training.returncode == 130 and "interrupted at step" in output, output[-4000:]
    assert "mlflow imported by the training: False" in output, output[-4000:]
    (run_dir,) = run_dirs(tmp_path)
    (run,) = mlflow_runs_of(store, run_dir)
    assert run.info.status == "FAILED"  # ended, as an interrupted run's tracker runs are
    steps = sorted(m.step for m in mlflow_client(store).get_metric_history(run.info.run_id, "train/loss"))
    assert steps == sorted(tensorboard_scalars(run_dir)["train/loss"]) and 1 < len(steps) < 160, steps


def test_the_trackers_process_imports_mlflow_and_its_store_and_nothing_else_it_would_not_use(tmp_path):
    """What the trackers' process imports is CPU time taken from the ranks' cores (docs/tracking.md, Cost): it
    imports MLflow and its store, and neither the training's torch, Hydra or OmegaConf nor the pandas, pyarrow
    and scipy that MLflow imports wherever they are installed. Its imports are read from Python's own record of
    them (PYTHONVERBOSE's line per module loaded, set for it alone), while it opens an MLflow run and logs a point and
    an image."""
    store = tmp_path / "mlflow.db"
    code = ("import os, sys\n"
            "from pathlib import Path\n"
            "import numpy, torch\n"
            "from ddp.reporting.tracker_process import TrackerProcess\n"
            "from ddp.reporting.trackers import TrackedRun\n"
            "os.environ['PYTHONVERBOSE'] = '1'  # read by the process it starts; this one's imports are done\n"
            "logger = {'tensorboard': {}, 'mlflow': {'tracking_uri': sys.argv[1], 'experiment': None}, 'wandb': None}\n"
            "trackers = TrackerProcess(lambda: (logger, TrackedRun(Path.cwd(), {'optim.lr': '0.1'}, None, []), []))\n"
            "trackers.add_scalar('train/loss', 0.5, 1)\n"
            "trackers.add_image('val/samples', numpy.zeros((8, 8, 3), numpy.uint8), 1)  # as RankZeroWriter sends it\n"
            "trackers.commit()\n"
            "trackers.close(failed=False)\n")
    done = subprocess.run([sys.executable, "-c", code, f"sqlite:///{store}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    imported = set(re.findall(r"^import '(\w+)", done.stderr, re.MULTILINE))  # the packages of the modules it loaded
    assert "mlflow" in imported and "sqlalchemy" in imported, done.stderr[-4000:]
    unused = {"torch", "hydra", "omegaconf", "pandas", "pyarrow", "scipy"}
    assert not imported & unused, sorted(imported & unused)
    (run,) = mlflow_runs(store)
    assert run.data.metrics == {"train/loss": 0.5} and run.data.params == {"optim.lr": "0.1"}
    (image,) = mlflow_client(store).list_artifacts(run.info.run_id, "val/samples")
    assert image.path == "val/samples/step_00000001.png"


def test_what_mlflows_import_goes_without_is_importable_again_after_it():
    """pandas, pyarrow and scipy are hidden only while MLflow imports (trackers.modules_hidden): W&B, in the same
    process, and anything after it import them as installed."""
    code = ("from ddp.reporting.trackers import MLFLOW_UNUSED_IMPORTS, modules_hidden\n"
            "with modules_hidden(MLFLOW_UNUSED_IMPORTS):\n"
            "    try:\n"
            "        import pandas\n"
            "    except ImportError:\n"
            "        print('hidden inside')\n"
            "import pandas, pyarrow, scipy\n"
            "print('imported after')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n")[:2] == ["hidden inside", "imported after"], done.stdout + done.stderr[-2000:]


# --- a tracker's own failure ------------------------------------------------------------------------------

def test_an_mlflow_server_gone_mid_run_is_one_line_and_the_run_and_its_files_go_on(tmp_path):
    """A tracking server killed once the run has logged to it: the run says so in one line, sends it nothing
    more, and ends as it would without it: every step in TensorBoard, results.json, the checkpoint."""
    from mlflow.tracking import MlflowClient

    port = free_port()
    server = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
              "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    slow = ["fault.slow_rank=0", "fault.slow_ms=150"]  # 32 steps: seconds of training left when the server goes
    with mlflow_server(server, port, tmp_path / "server.log") as url:
        training = subprocess.Popen(
            [sys.executable, str(TRAIN), *TINY, *slow, "trainer.log_every_n_steps=1", "logger=[tensorboard,mlflow]",
             f"logger.mlflow.tracking_uri={url}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        client = MlflowClient(url)

        def logged_a_step() -> bool:
            assert training.poll() is None, training.communicate()[0][-4000:]
            experiment = client.get_experiment_by_name("hydra-ddp")
            runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
            return any("train/loss" in run.data.metrics for run in runs)

        while not logged_a_step():
            time.sleep(0.2)
    output, _ = training.communicate(timeout=300)  # the server is gone
    assert training.returncode == 0, output[-6000:]
    warnings = [line for line in output.splitlines() if "[WARNING]" in line and "fault.slow_rank" not in line]
    assert len(warnings) == 1 and "logger=mlflow failed (API request to" in warnings[0], output[-6000:]
    assert warnings[0].endswith("it logs nothing more; the run and its files go on") and "Traceback" not in output
    (run_dir,) = [p for p in (tmp_path / "outputs").iterdir() if (p / "train_rank0.log").exists()]
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 32
    assert sorted(tensorboard_scalars(run_dir)["train/loss"]) == list(range(1, 33))
    assert (run_dir / "checkpoints" / "last.pt").exists()


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return children


def test_the_tracker_process_killed_mid_run_is_one_line_and_the_run_and_its_files_go_on(tmp_path):
    """The trackers' process killed (as the out-of-memory killer would) once MLflow has its run: one line,
    and the run ends as it would without it: every step in TensorBoard, results.json, the checkpoint."""
    # 64 steps of 300 ms: seconds of training left after MLflow's start, which has taken 11 s on a loaded 2-core machine
    slow = ["trainer.max_epochs=4", "fault.slow_rank=0", "fault.slow_ms=300"]
    training = subprocess.Popen([sys.executable, str(TRAIN), *TINY, *slow, "trainer.log_every_n_steps=1", "logger=[tensorboard,mlflow]"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
    output = lines_until_the_mlflow_run(training)
    (tracker_process,) = [pid for pid, command in _children(training.pid).items() if "ddp.reporting.tracker_process" in command]
    os.kill(tracker_process, signal.SIGKILL)
    rest, _ = training.communicate(timeout=300)
    output = "".join(output) + rest
    assert training.returncode == 0, output[-6000:]
    warnings = [line for line in output.splitlines() if "[WARNING]" in line and "fault.slow_rank" not in line]
    assert len(warnings) == 1 and "the trackers' process ended early (" in warnings[0], output[-6000:]
    assert warnings[0].endswith("they log nothing more; the run and its files go on") and "Traceback" not in output
    (run_dir,) = run_dirs(tmp_path)
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 64
    assert sorted(tensorboard_scalars(run_dir)["train/loss"]) == list(range(1, 65))
    assert (run_dir / "checkpoints" / "last.pt").exists()


# --- bad settings: one line each, before anything starts ------------------------------------------------

def test_an_unreachable_mlflow_server_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{free_port()}"
    line = config_error_in_this_process([*TINY, "logger=mlflow", f"logger.mlflow.tracking_uri={uri}"], tmp_path / "run")
    assert line.startswith(f"logger.mlflow.tracking_uri={uri}: the server can't be reached"), line


@pytest.mark.parametrize("setting, expected", [
    ("logger.mlflow.tracking_uri=localhost:5000", "logger.mlflow.tracking_uri=localhost:5000: not a tracking URI"),
    ("logger.wandb.mode=sometimes", "logger.wandb.mode=sometimes: unknown, use one of auto, online, offline"),
])
def test_bad_tracker_settings_are_one_line(tmp_path, monkeypatch, setting, expected):
    monkeypatch.chdir(tmp_path)
    line = config_error_in_this_process([*TINY, "logger=[mlflow,wandb]", setting], tmp_path / "run")
    assert line.startswith(expected), line


def test_wandb_online_without_a_key_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    line = config_error_in_this_process([*TINY, "logger=wandb", "logger.wandb.mode=online"], tmp_path / "run")
    assert line.startswith("logger.wandb.mode=online: no W&B API key"), line


def test_a_wandb_variable_that_wandb_rejects_is_one_line_on_the_command_line(tmp_path):
    """WANDB_MODE="" (which W&B's settings refuse when its run starts) with logger=wandb: one line naming the
    variable, exit 1, no run dir and no W&B files; before the check, the run trained without W&B."""
    result = launch([*TINY, "logger=wandb"], tmp_path, env={"WANDB_MODE": ""}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: WANDB_MODE='' in the environment: W&B rejects it (Input should be 'online', 'offline', 'shared', 'disabled', "
        "'dryrun' or 'run'); set a value W&B accepts, or unset it"], result.stderr
    assert_no_run_dir_left(tmp_path)
    assert not list(tmp_path.rglob("wandb"))


@pytest.mark.parametrize("name, value, expected", [
    ("WANDB_SILENT", "maybe", "WANDB_SILENT='maybe' in the environment: W&B rejects it (Input should be a valid boolean"),
    ("WANDB_API_KEY", " secret ", "WANDB_API_KEY in the environment: W&B rejects it (API key cannot start or end with whitespace)"),
])
def test_other_wandb_variables_that_wandb_rejects_are_one_line(tmp_path, monkeypatch, name, value, expected):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    line = config_error_in_this_process([*TINY, "logger=wandb"], tmp_path / "run")
    assert line.startswith(expected), line
    assert "secret" not in line


def test_unknown_logger_options_and_keys_are_named_by_hydra(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        with pytest.raises(MissingConfigException, match="logger/neptune"):
            compose("config", overrides=["logger=[tensorboard,neptune]"])
        with pytest.raises(ConfigCompositionException, match="logger.mlflow.experimnet"):
            compose("config", overrides=["logger=mlflow", "logger.mlflow.experimnet=x"])


def test_a_missing_extra_is_one_line_naming_the_install_command(tmp_path):
    """train.py in a Python environment without mlflow: the site-packages minus mlflow's, linked."""
    import site

    (site_packages,) = [Path(p) for p in site.getsitepackages() if Path(p, "torch").exists()]
    without = tmp_path / "site-packages"
    without.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith("mlflow"):
            (without / entry.name).symlink_to(entry)
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{without}"}
    result = subprocess.run([sys.executable, "-S", str(TRAIN), *TINY, "logger=[tensorboard,mlflow]"], cwd=tmp_path,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "mlflow" in line]
    assert lines == ["error: logger=mlflow: mlflow is not installed; install it with: make install EXTRAS=mlflow "
                     "(or, in an environment of your own: pip install -e '.[mlflow]')"], lines
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


def test_a_continued_run_sends_a_tracker_the_journaled_points_it_missed(runs, tmp_path):
    """An attempt whose MLflow run missed steps 3 to 5 (its tracker failed), killed while journaling step 6;
    the next attempt, resumed from step 4's checkpoint, first sends MLflow the journaled steps 3 and 4,
    and not 5, which it computes again."""
    from ddp.distributed.env import DistEnv
    from ddp.reporting.rank_zero import RankZeroWriter
    from ddp.reporting.trackers import JOURNAL_FILE, PointJournal, TrackedRun, open_trackers

    logger = OmegaConf.create({"mlflow": {"tracking_uri": f"sqlite:///{runs['cwd'] / 'outputs' / 'mlflow.db'}",
                                          "experiment": "journal"}})
    run, rank_zero = TrackedRun(tmp_path, {}, None, []), DistEnv(rank=0, world_size=1)

    def attempt(purge_step: int | None) -> RankZeroWriter:
        journal = PointJournal(tmp_path, purge_step)
        trackers = open_trackers(logger, run, journal.earlier)
        return RankZeroWriter(tmp_path, rank_zero, tensorboard=False, trackers=trackers, journal=journal)

    with attempt(purge_step=None) as writer:
        for step in range(1, 6):
            if step == 3:
                writer.trackers = []  # as RankZeroWriter leaves them when the tracker fails
            writer.add_scalar("train/loss", step / 10, step)
            writer.commit()
    with open(tmp_path / JOURNAL_FILE, "a") as journal:
        journal.write('["train/loss", 0.')  # a line cut short by a kill
    with attempt(purge_step=5):
        pass
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    history = _client(runs["cwd"]).get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert [json.loads(line) for line in (tmp_path / JOURNAL_FILE).read_text().splitlines()] == [
        ["train/loss", step / 10, step] for step in range(1, 5)]


# --- images ----------------------------------------------------------------------------------------------

def test_a_continued_run_sends_the_trackers_the_journaled_images_they_missed(runs, tmp_path):
    """An attempt logs a validation's image grid at steps 2, 3 and 5, its trackers gone after step 2 (as killed
    with the image still queued); the next attempt, resumed from step 5's checkpoint, sends MLflow and W&B the
    journaled image of step 3, pixel for pixel, at its step and after its step's scalars, and not that of step 5,
    which it computes again: its PNG is gone from the run dir."""
    import numpy
    import torch
    from PIL import Image

    from ddp.distributed.env import DistEnv
    from ddp.reporting.rank_zero import RankZeroWriter
    from ddp.reporting.trackers import JOURNAL_IMAGES, PointJournal, TrackedRun, open_trackers

    logger = OmegaConf.create({"mlflow": {"tracking_uri": f"sqlite:///{runs['cwd'] / 'outputs' / 'mlflow.db'}",
                                          "experiment": "journaled-images"},
                               "wandb": {"project": "journaled-images", "entity": None, "mode": "offline"}})
    run, rank_zero = TrackedRun(tmp_path, {}, None, []), DistEnv(rank=0, world_size=1)
    grids = {step: torch.rand(3, 10, 14, generator=torch.Generator().manual_seed(step)) for step in (2, 3, 5)}

    def attempt(purge_step: int | None) -> RankZeroWriter:
        journal = PointJournal(tmp_path, purge_step)
        trackers = open_trackers(logger, run, journal.earlier)
        return RankZeroWriter(tmp_path, rank_zero, tensorboard=False, trackers=trackers, journal=journal)

    with attempt(purge_step=None) as writer:
        trackers = list(writer.trackers)
        for step in range(1, 6):
            if step == 3:
                writer.trackers = []
            writer.add_scalar("train/loss", step / 10, step)
            writer.commit()
            if step in grids:
                writer.add_image("val/images", grids[step], step)
    for tracker in trackers:
        tracker.close(failed=True)
    with attempt(purge_step=5):
        pass
    assert sorted(p.name for p in (tmp_path / JOURNAL_IMAGES).rglob("*.png")) == ["step_00000002.png", "step_00000003.png"]
    pixels = {step: (grids[step] * 255).round().byte().permute(1, 2, 0).numpy() for step in (2, 3)}
    state = json.loads((tmp_path / "trackers.json").read_text())
    client = _client(runs["cwd"])
    assert [a.path for a in client.list_artifacts(state["mlflow"]["run_id"], "val/images")] == [
        "val/images/step_00000002.png", "val/images/step_00000003.png"]
    for step in (2, 3):
        sent = client.download_artifacts(state["mlflow"]["run_id"], f"val/images/step_{step:08d}.png", str(tmp_path))
        assert numpy.array_equal(numpy.asarray(Image.open(sent)), pixels[step])
    first, second = sorted(tmp_path.glob(f"wandb/offline-run-*/run-{state['wandb']['id']}.wandb"))
    _, history, steps = wandb_history(tmp_path)
    assert steps == [1, 2, 3, 4] and history["train/loss"] == {step: step / 10 for step in range(1, 5)}
    assert sorted(history["val/images/path"]) == [2, 3]
    image = second.parent / "files" / history["val/images/path"][3]
    assert numpy.array_equal(numpy.asarray(Image.open(image).convert("RGB")), pixels[3])


def test_segmentations_image_grid_goes_to_mlflow_and_wandb(runs, tmp_path):
    """task=segmentation's validation grid (the writer's add_image): an MLflow artifact and a W&B image, at its step."""
    import torch

    from data.shapes import build_shapes
    from ddp.distributed.env import DistEnv
    from ddp.reporting.rank_zero import RankZeroWriter
    from ddp.reporting.trackers import TrackedRun, open_trackers
    from models.segmentation import small_segnet
    from tasks.segmentation import SegmentationTask

    splits = build_shapes(num_samples=8, num_val_samples=6, image_size=20, num_classes=4, data_seed=0)
    task = SegmentationTask(4, splits.class_names, num_images_logged=4)
    store = runs["cwd"] / "outputs" / "mlflow.db"
    logger = OmegaConf.create({"mlflow": {"tracking_uri": f"sqlite:///{store}", "experiment": "images"},
                               "wandb": {"project": "images", "entity": None, "mode": "offline"}})
    trackers = open_trackers(logger, TrackedRun(tmp_path, {}, None, []), earlier_points=[])
    assert [tracker.name for tracker in trackers] == ["mlflow", "wandb"]
    with RankZeroWriter(tmp_path, DistEnv(rank=0, world_size=1), tensorboard=False, trackers=trackers) as writer:
        task.log_validation(writer, small_segnet(4, 3, width=4).eval(), splits.val, torch.device("cpu"), step=7)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    assert [a.path for a in _client(runs["cwd"]).list_artifacts(run_id, "val/images")] == ["val/images/step_00000007.png"]
    assert list((runs["cwd"] / "outputs" / "mlflow-artifacts").glob(f"{run_id}/artifacts/val/images/step_00000007.png"))
    (history,) = [record.history for path in tmp_path.glob("wandb/offline-run-*/run-*.wandb") for record in wandb_records(path)
                  if record.WhichOneof("record_type") == "history"]
    step = [json.loads(item.value_json) for item in history.item if list(item.nested_key) == ["_step"]]
    image = {item.nested_key[1]: json.loads(item.value_json) for item in history.item if item.nested_key[0] == "val/images"}
    assert step == [7] and image["_type"] == "image-file" and (image["width"], image["height"]) == (68, 90)
    (attempt,) = tmp_path.glob("wandb/offline-run-*")
    assert (attempt / "files" / image["path"]).stat().st_size == image["size"]
