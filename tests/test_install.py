"""What each make target installs into .venv/ (the Makefile's stamps): `make train` the runtime dependencies
alone, `make test` the test extras, `make install EXTRAS=<tracker>` a tracker's, each once.

make runs for real, on a .venv/ of its own in tmp_path whose `python`, `uv` and `mlflow` only record the command
they are given: a real install is gigabytes of torch. uv installs, given the package sources pip is configured with
(scripts/pip_sources.py, run for real here with a pip configuration of the test's own)."""

import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO

RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../commands.log"\n'


@pytest.fixture
def venv(tmp_path):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "uv", "mlflow"):
        (bin_dir / tool).write_text(RECORDER)
        (bin_dir / tool).chmod(0o755)
    return tmp_path / "venv"


def make(venv, *args: str) -> list[str]:
    """`make <args>` with VENV=venv; the commands its .venv/ was given, one line each."""
    result = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args, f"VENV={venv}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    log = venv / "commands.log"
    commands = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return commands


def install(venv, extras: str = "") -> list[str]:
    """The commands of one install of the project with `extras` (".[test]"): uv's own, pip's sources, then uv."""
    uv_version = re.search(r"^UV_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    return [f"python -m pip install --quiet uv=={uv_version}", "python scripts/pip_sources.py",
            f"uv pip install --quiet --python {venv}/bin/python --index-strategy unsafe-best-match -e .{extras}"]


def test_make_train_installs_the_runtime_dependencies_alone(venv):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {requirement.split("==")[0] for requirement in project["dependencies"]}
    assert not runtime & {"pytest", "pytest-xdist", "selenium", "mlflow", "wandb"}, runtime
    assert make(venv, "train") == [*install(venv), "python train.py"]
    assert make(venv, "train") == ["python train.py"]  # installed once
    assert make(venv, "install") == []


def test_make_test_installs_the_test_extras_which_serve_every_other_target(venv):
    """`make test` installs pytest, selenium and both trackers, sets up the machine (a recorder here, for
    scripts/test-setup.sh: tests/test_test_setup.py), then runs the suite; the suite's own `make mlflow-ui` then
    installs nothing (an install during the suite would swap the package under the running tests)."""
    setup = venv / "bin" / "test-setup"
    setup.write_text('#!/bin/sh\necho test-setup >> "$(dirname "$0")/../commands.log"\n')
    setup.chmod(0o755)
    assert make(venv, "test", f"TEST_SETUP={setup}") == [*install(venv, "[test]"), "test-setup", "python -m pytest -q -n 4 --dist worksteal"]
    assert make(venv, "mlflow-ui", "MLFLOW_PORT=5999")[0].startswith("mlflow ui --backend-store-uri sqlite:///")
    for target in (["train"], ["bench"], ["install", "EXTRAS=mlflow"], ["install", "EXTRAS=mlflow,wandb"]):
        assert not [command for command in make(venv, *target) if " install " in command], target


def test_make_test_sets_up_the_machine_with_the_projects_script_after_the_install(venv):
    """Without TEST_SETUP, `make test` runs scripts/test-setup.sh (printed, not run: make -n), between the
    install and pytest."""
    result = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "test", f"VENV={venv}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["scripts/test-setup.sh", f"{venv}/bin/python -m pytest -q -n 4 --dist worksteal"], lines
    assert any(" install " in line for line in lines[:-2]), lines


def test_a_trackers_extra_comes_with_make_install_extras_or_the_target_that_needs_it(venv):
    assert make(venv, "install", "EXTRAS=wandb") == install(venv, "[wandb]")
    assert make(venv, "mlflow-ui")[:3] == install(venv, "[mlflow]")
    assert make(venv, "install", "EXTRAS=mlflow") == []
    assert make(venv, "train") == ["python train.py"]  # the runtime dependencies came with the extras
    assert make(venv, "bench") == [*install(venv, "[mlflow,wandb,bench]"), "python benchmarks/bench.py"]


def test_targets_write_bytecode_even_where_the_environment_says_not_to(venv, monkeypatch):
    """The install compiles no bytecode, so each module's is written at its first import; with
    PYTHONDONTWRITEBYTECODE set every process would compile torch's modules again."""
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "python $* PYTHONDONTWRITEBYTECODE=[$PYTHONDONTWRITEBYTECODE]" '
                                         '>> "$(dirname "$0")/../commands.log"\n')
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert make(venv, "train")[-1] == "python train.py PYTHONDONTWRITEBYTECODE=[]"


def test_where_uv_fails_pip_installs(venv):
    (venv / "bin" / "uv").write_text(RECORDER + "exit 1\n")
    assert make(venv, "train") == [*install(venv), "python -m pip install --quiet --no-compile -e .", "python train.py"]


def test_where_uv_cant_be_installed_pip_installs(venv):
    (venv / "bin" / "python").write_text(RECORDER + 'case "$*" in *uv==*) exit 1;; esac\n')
    assert make(venv, "train") == [install(venv)[0], "python -m pip install --quiet --no-compile -e .", "python train.py"]


def test_uv_is_given_the_package_sources_pip_is_configured_with(tmp_path):
    """Index URLs, wheel folders and constraints from pip's configuration files and PIP_* variables, each once."""
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url = file:///srv/a file:///srv/b\nfind-links = /srv/wheels\n"
                      "constraint = /srv/caps.txt\ntimeout = 60\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": str(config), "PIP_FIND_LINKS": "/srv/wheels",
           "PIP_INDEX_URL": "https://mirror.example/simple"}
    result = subprocess.run([sys.executable, "scripts/pip_sources.py"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    options = list(zip(words[::2], words[1::2]))
    assert len(options) == len(set(options)), options
    assert {("--extra-index-url", "file:///srv/a"), ("--extra-index-url", "file:///srv/b"), ("--find-links", "/srv/wheels"),
            ("--constraint", "/srv/caps.txt"), ("--index-url", "https://mirror.example/simple")} <= set(options), options
