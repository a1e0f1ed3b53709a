"""The README's "Adding a model", "Adding a dataset" and "Adding a task" examples, run as a user would: each file the
section shows is written where its first line says, in a copy of the repository; each `bash` block
runs there, with `python` the interpreter running this suite; each `console` block's command must
print exactly the line the README shows (on stderr) and exit 1, having trained nothing."""

import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, run_dirs
from models import build_model

README = REPO / "README.md"
CODE_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_section(title: str, page: Path = README) -> str:
    """The text under the heading `title` (any level) of the README (or of `page`), up to the next heading
    of its level or above."""
    lines = page.read_text().splitlines(keepends=True)
    (start,) = [i for i, line in enumerate(lines) if re.fullmatch(rf"(#+) {re.escape(title)}\n", line)]
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i]) and not _in_code(lines, i)), len(lines))
    return "".join(lines[start + 1:end])


def _in_code(lines: list[str], index: int) -> bool:
    return sum(line.startswith("```") for line in lines[:index]) % 2 == 1


def code_blocks(section: str, language: str) -> list[str]:
    return [body for lang, body in CODE_BLOCK.findall(section) if lang == language]


def write_example(section: str, repo: Path) -> dict[str, str]:
    """Every python and yaml block of the section whose first line is `# <path>`, written at that path."""
    files = {}
    for body in code_blocks(section, "python") + code_blocks(section, "yaml"):
        match = re.match(r"# (\S+)\n", body)
        if match:
            (repo / match[1]).write_text(body)
            files[match[1]] = body
    return files


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    return copy_of_repo(tmp_path / "repo")


def copy_of_repo(copy: Path) -> Path:
    """The repository's tracked files at `copy`, as a user's clone holds them (without this machine's outputs/)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, tracked.split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    return copy


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` in bash, with `python` this suite's interpreter and no GPU (as the whole suite)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH")}
    return subprocess.run(["bash", "-e", "-c", command], cwd=cwd, env=env | {"PATH": path, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=300)


def run_bash_blocks(section: str, cwd: Path) -> None:
    blocks = code_blocks(section, "bash")
    assert blocks, "the section shows no command to run"
    for block in blocks:
        result = shell(block, cwd)
        assert result.returncode == 0, f"{block}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def check_console_blocks(section: str, cwd: Path) -> int:
    """Each `$ command` with the line it prints: exit 1, exactly that line on stderr, no run trained."""
    checked = 0
    for block in code_blocks(section, "console"):
        command, *expected = block.rstrip("\n").split("\n")
        assert command.startswith("$ ") and len(expected) == 1, block
        before = set(cwd.rglob("*.pt")) | set(cwd.rglob("events.out.tfevents*"))
        result = shell(command.removeprefix("$ "), cwd)
        assert result.returncode == 1, f"{command}\n{result.stdout}\n{result.stderr}"
        assert result.stderr.strip().splitlines() == expected, result.stderr
        assert set(cwd.rglob("*.pt")) | set(cwd.rglob("events.out.tfevents*")) == before, "it trained"
        checked += 1
    return checked


def last_run(cwd: Path) -> tuple[dict, dict]:
    """The newest run's final checkpoint (a dict of tensors and containers) and its results.json."""
    run_dir = run_dirs(cwd)[-1]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    return checkpoint, json.loads((run_dir / "results.json").read_text())


def override(commands: list[str], key: str) -> str | None:
    values = [match for command in commands for match in re.findall(rf"(?<![\w.]){re.escape(key)}=(\S+)", command)]
    return values[-1] if values else None


def test_adding_a_model_runs_as_the_readme_shows(repo_copy):
    """The model trains with the width the README sets (its conv has that many filters in the saved
    checkpoint), and the misspelt option is refused in one line."""
    section = readme_section("Adding a model")
    files = write_example(section, repo_copy)
    assert {"models/my_net.py", "conf/model/my_net.yaml"} <= files.keys(), files.keys()
    run_bash_blocks(section, repo_copy)

    commands = code_blocks(section, "bash")
    width = int(override(commands, "model.width") or OmegaConf.create(files["conf/model/my_net.yaml"]).width)
    checkpoint, results = last_run(repo_copy)
    conv = next(tensor for key, tensor in checkpoint["model"].items() if tensor.dim() == 4)
    assert conv.shape[0] == width, (conv.shape, width)
    assert checkpoint["config"]["model"]["width"] == width
    assert results["steps"] >= 1
    assert check_console_blocks(section, repo_copy) >= 1


def test_adding_a_dataset_runs_as_the_readme_shows(repo_copy):
    """The model trains on the files at data.root: their val split is what it was evaluated on, and
    their channel count is what its first layer takes; the misspelt option is refused in one line."""
    section = readme_section("Adding a dataset")
    files = write_example(section, repo_copy)
    assert {"data/my_data.py", "conf/data/my_data.yaml"} <= files.keys(), files.keys()
    run_bash_blocks(section, repo_copy)

    root = repo_copy / override(code_blocks(section, "bash")[-1:], "data.root")
    val = torch.load(root / "val.pt", weights_only=True)
    channels = torch.load(root / "train.pt", weights_only=True)["images"].shape[1]
    checkpoint, results = last_run(repo_copy)
    assert results["val_samples"] == len(val["labels"])
    conv = next(tensor for key, tensor in checkpoint["model"].items() if tensor.dim() == 4)
    assert conv.shape[1] == channels
    assert check_console_blocks(section, repo_copy) >= 1



def load_module(path: Path):
    """A module of the example, by its file (the suite imports this checkout's packages, not the copy's)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adding_a_task_runs_as_the_readme_shows(repo_copy):
    """The task trains, and its objective, the value main returns, is in results.json: equal to the
    metric scikit-learn computes from the saved model's predictions on the whole val split (so the
    task's eval sums add up exactly); the misspelt option is refused in one line."""
    from sklearn.metrics import accuracy_score, f1_score  # here: collecting the suite needn't import it

    section = readme_section("Adding a task")
    files = write_example(section, repo_copy)
    assert {"tasks/multilabel.py", "conf/task/multilabel.yaml"} <= files.keys(), files.keys()
    run_bash_blocks(section, repo_copy)

    checkpoint, results = last_run(repo_copy)
    config = OmegaConf.create(checkpoint["config"])
    task_yaml = OmegaConf.create(files["conf/task/multilabel.yaml"])
    assert config.task._target_ == task_yaml._target_ and results["steps"] >= 1
    data_module = load_module(repo_copy / (config.data._target_.rsplit(".", 1)[0].replace(".", "/") + ".py"))
    build_data = data_module.build
    options = {key: config.data[key] for key in inspect.signature(build_data).parameters if key in config.data}
    val = build_data(**options).val
    images, truth = val.tensors
    model = build_model(config.model, num_classes=truth.shape[1], in_channels=images.shape[1])
    model.load_state_dict(checkpoint["model"])
    with torch.no_grad():
        predicted = (model.eval()(images).sigmoid() > task_yaml.threshold).int().numpy()
    truth = truth.int().numpy()
    assert results["val_samples"] == len(truth)
    assert results[task_yaml.objective] == pytest.approx(f1_score(truth, predicted, average="macro", zero_division=0), abs=1e-12)
    assert results["val_exact_match"] == pytest.approx(accuracy_score(truth, predicted), abs=1e-12)
    assert results[task_yaml.objective] > 0.5  # it learned
    assert check_console_blocks(section, repo_copy) >= 1
