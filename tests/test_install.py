"""What each make target installs into .venv/ (the Makefile's stamps): `make train` the runtime dependencies
alone, `make test` the test extras, `make install EXTRAS=<tracker>` a tracker's, each once.

make runs for real, on a .venv/ of its own in tmp_path whose `python` and `mlflow` only record the command
they are given: a real install is gigabytes of torch."""

import subprocess
import tomllib

import pytest

from conftest import REPO

RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../commands.log"\n'


@pytest.fixture
def venv(tmp_path):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "mlflow"):
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


def test_make_train_installs_the_runtime_dependencies_alone(venv):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {requirement.split("==")[0] for requirement in project["dependencies"]}
    assert not runtime & {"pytest", "pytest-xdist", "selenium", "mlflow", "wandb"}, runtime
    assert make(venv, "train") == ["python -m pip install --quiet --no-compile -e .", "python train.py"]
    assert make(venv, "train") == ["python train.py"]  # installed once
    assert make(venv, "install") == []


def test_make_test_installs_the_test_extras_which_serve_every_other_target(venv):
    """`make test` installs pytest, selenium and both trackers; the suite's own `make mlflow-ui` then
    installs nothing (an install during the suite would swap the package under the running tests)."""
    assert make(venv, "test") == ["python -m pip install --quiet --no-compile -e .[test]", "python -m pytest -q -n 2"]
    assert make(venv, "mlflow-ui", "MLFLOW_PORT=5999")[0].startswith("mlflow ui --backend-store-uri sqlite:///")
    for target in (["train"], ["bench"], ["install", "EXTRAS=mlflow"], ["install", "EXTRAS=mlflow,wandb"]):
        assert not [command for command in make(venv, *target) if " pip " in command], target


def test_a_trackers_extra_comes_with_make_install_extras_or_the_target_that_needs_it(venv):
    assert make(venv, "install", "EXTRAS=wandb") == ["python -m pip install --quiet --no-compile -e .[wandb]"]
    assert make(venv, "mlflow-ui")[0] == "python -m pip install --quiet --no-compile -e .[mlflow]"
    assert make(venv, "install", "EXTRAS=mlflow") == []
    assert make(venv, "train") == ["python train.py"]  # the runtime dependencies came with the extras
    assert make(venv, "bench") == ["python -m pip install --quiet --no-compile -e .[mlflow,wandb,bench]", "python benchmarks/bench.py"]


def test_targets_write_bytecode_even_where_the_environment_says_not_to(venv, monkeypatch):
    """The install compiles no bytecode (pip --no-compile), so each module's is written at its first import;
    with PYTHONDONTWRITEBYTECODE set every process would compile torch's modules again."""
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "python $* PYTHONDONTWRITEBYTECODE=[$PYTHONDONTWRITEBYTECODE]" '
                                         '>> "$(dirname "$0")/../commands.log"\n')
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert make(venv, "train") == ["python -m pip install --quiet --no-compile -e . PYTHONDONTWRITEBYTECODE=[]",
                                   "python train.py PYTHONDONTWRITEBYTECODE=[]"]
