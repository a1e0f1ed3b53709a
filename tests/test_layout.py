"""The code's layout stays readable (docs/layout.md): `ddp/`'s folders are layers, each importing only
those below it, and the other import contracts of pyproject.toml hold (import-linter, lazy imports
included); no import cycles among the project's modules; `ddp/` grouped into a few folders of a few
modules each; no signature that state is passed through by hand; train.py short enough to read as the
recipe. Read from the source, nothing of the project is run."""
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ddp", "models", "data", "tasks")
RECIPES = ("train.py", "evaluate.py")
MAX_TRAIN_PY_PARAMETERS = 7  # a function of train.py
MAX_PARAMETERS = 8  # a call in train.py; a function or constructor of ddp/
# They mirror a signature that isn't ours: torch's BatchNorm, and the inputs of the op an autograd Function computes.
EXEMPT = {"ddp/distributed/syncbn.py:CPUSyncBatchNorm.__init__", "ddp/distributed/syncbn.py:_SyncBatchNormFn.forward"}


def test_ddps_folders_are_layers_and_the_import_contracts_hold():
    """`lint-imports` checks pyproject.toml's contracts: a failure names the contract and the chain of
    imports that breaks it (`ddp.config.checks -> ddp.loading.batches (l.12)`)."""
    lint = subprocess.run([Path(sys.executable).with_name("lint-imports"), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout[lint.stdout.find("Broken contracts"):] + lint.stderr


def test_the_layout_page_shows_the_layers_of_the_contract():
    """docs/layout.md's table of layers lists ddp/'s folders in the contract's order, bottom to top."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [contract["layers"] for contract in contracts if contract["type"] == "layers"]
    bottom_up = [{name.strip() for name in layer.split("|")} for layer in reversed(layers)]
    page = (REPO / "docs" / "layout.md").read_text()
    table = page[page.index("## The layers"):page.index("## Every module")]
    documented = [{re.sub(r"^ddp/|/$|\.py$", "", name) for name in re.findall(r"`(ddp/[^`]+)`", row.split("|")[1])}
                  for row in table.splitlines() if row.startswith("| `ddp/")]
    assert documented == bottom_up, (documented, bottom_up)


def modules() -> dict[str, Path]:
    """Every project module by its dotted name: the packages' and the recipes beside them."""
    found = {path.stem: REPO / path for path in map(Path, RECIPES)}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in it, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name in known}


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    cycles, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":  # on the way here: a circle
                cycles.append(" -> ".join(stack[stack.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, stack + [imported])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_ddp_reads_as_a_table_of_contents():
    ddp = REPO / "ddp"
    folders = sorted(path for path in ddp.iterdir() if (path / "__init__.py").exists())
    sizes = {folder.name: len([p for p in folder.glob("*.py") if p.name != "__init__.py"]) for folder in folders}
    loose = [path.name for path in ddp.glob("*.py") if path.name != "__init__.py"]
    assert 4 <= len(folders) <= 9 and all(2 <= size <= 9 for size in sizes.values()), sizes
    assert len(loose) <= 3, loose
    assert not [p for p in ddp.rglob("*.py") if p.parent.parent != ddp and p.parent != ddp], "one level of folders"


def parameter_count(function: ast.FunctionDef) -> int:
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    return len([name for name in names if name not in ("self", "cls")]) + bool(arguments.vararg) + bool(arguments.kwarg)


def signatures(path: Path):
    """(`path:Class.function`, parameter count) of every function in the file, methods included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(REPO)}:{prefix}{child.name}", parameter_count(child)
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
    yield from walk(ast.parse(path.read_text()), "")


def test_no_signature_passes_the_run_by_hand():
    """The run context (ddp/run_context.py) carries what every stage reads; what is left is each stage's own."""
    too_wide = {}
    for name, count in signatures(REPO / "train.py"):
        if count > MAX_TRAIN_PY_PARAMETERS:
            too_wide[name] = count
    for node in ast.walk(ast.parse((REPO / "train.py").read_text())):
        if isinstance(node, ast.Call) and len(node.args) + len(node.keywords) > MAX_PARAMETERS:
            too_wide[f"train.py:{ast.unparse(node.func)}(...)"] = len(node.args) + len(node.keywords)
    for path in sorted((REPO / "ddp").rglob("*.py")):
        for name, count in signatures(path):
            if count > MAX_PARAMETERS and name not in EXEMPT:
                too_wide[name] = count
    assert not too_wide, too_wide


def test_train_py_reads_as_the_recipe():
    source = (REPO / "train.py").read_text()
    assert len(source.splitlines()) <= 250
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60}
    assert not long, long
