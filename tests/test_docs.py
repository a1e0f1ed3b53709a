"""The README stays a short newcomer's page; every relative link in it and in docs/ leads
somewhere (a file of the repository and, with a `#anchor`, a heading of that file); and every
documented command names Makefile targets that exist and config keys, groups and options that compose."""
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from ddp.config.schema import register_configs

register_configs()

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(page: Path) -> list[str]:
    """The lines outside fenced code blocks, where a `# comment` is no heading and `[a](b)` no link."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose_lines(page):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for line in prose_lines(page) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: lead elsewhere


def test_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in pages():
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    """A reader finds each docs page by following links from the README (this also keeps the checks
    above from passing on pages whose links they don't see)."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        for target in relative_links(page):
            linked = (page.parent / target.partition("#")[0]).resolve()
            if linked.suffix == ".md" and linked.exists() and linked not in reached:
                reached.add(linked)
                todo.append(linked)
    unreached = [page.name for page in (REPO / "docs").glob("*.md") if page.resolve() not in reached]
    assert not unreached, f"docs pages no link leads to: {unreached}"


def test_headings_give_the_anchors_a_reader_links_to():
    readme_anchors = anchors(REPO / "README.md")
    assert {"adding-a-model", "adding-a-dataset", "adding-a-task", "options", "layout"} <= readme_anchors
    assert slug("`mode=eval` and `resume`") == "modeeval-and-resume"
    assert "elastic-scale-down" in anchors(REPO / "docs" / "fault-tolerance.md")


def test_readme_lists_every_option_of_each_group():
    """Each group's "Options:" line in the README names every option in conf/<group>/ (fsdp once went
    unlisted)."""
    sections = re.findall(r"^### `(\w+)`\n\nOptions: (.*)$", (REPO / "README.md").read_text(), re.M)
    assert {"strategy", "model", "data", "optim", "scheduler", "task"} <= {group for group, _ in sections}
    unlisted = [f"{group}={option}" for group, line in sections for option in
                sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml")) if f"`{option}`" not in line]
    assert not unlisted, f"README.md's Options lines leave out {unlisted}"


def test_readmes_data_defaults_hold_for_every_data_option():
    """The README's default batch size and workers are the default data option's, and the options whose
    workers differ are named with theirs (the README once said 0 workers where imagefolder starts 4)."""
    (row,) = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `data.batch_size`, `data.num_workers` |")]
    stated = row.split("|")[2].strip()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        default = compose("config").data
        options = sorted(p.stem for p in (REPO / "conf" / "data").glob("*.yaml"))
        workers = {option: compose("config", overrides=[f"data={option}"]).data.num_workers for option in options}
    others = sorted({count for count in workers.values()} - {default.num_workers})
    named = "; ".join(f"{count} for {', '.join(f'`{o}`' for o in options if workers[o] == count)}" for count in others)
    assert stated == f"{default.batch_size}, {default.num_workers}" + (f" (workers: {named})" if named else ""), row


def test_the_changelog_keeps_its_shape_and_every_breaking_change_says_how_to_migrate():
    """CHANGELOG.md, linked from the README: "Keep a Changelog"'s headings, every **BREAKING** entry with
    its `Migration:`, and each module move it lists leads to a module that exists (through the moves listed after
    it, where its module moved again), from one that doesn't."""
    import importlib.util

    text = (REPO / "CHANGELOG.md").read_text()
    assert "(CHANGELOG.md)" in (REPO / "README.md").read_text()
    versions = re.findall(r"^## (.*)$", text, re.M)
    assert versions[0] == "[Unreleased]" and all(re.fullmatch(r"\[\d+\.\d+\.\d+\] - \d{4}-\d\d-\d\d", v) for v in versions[1:])
    assert set(re.findall(r"^### (.*)$", text, re.M)) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    entries = re.split(r"^- ", text, flags=re.M)[1:]
    breaking = [entry for entry in entries if entry.startswith("**BREAKING**")]
    assert len(breaking) >= 3 and all("Migration:" in entry for entry in breaking), breaking
    moves = re.findall(r"^  \| `(ddp\.[\w.]+)` \| `(ddp\.[\w.]+)`", text, re.M)
    assert len(moves) >= 30
    moved_again = dict(moves)
    for old, new in moves:
        while new in moved_again:
            new = moved_again[new]
        assert importlib.util.find_spec(new) is not None, new
        assert old == "ddp.config" or importlib.util.find_spec(old) is None, old  # ddp.config is a package now


def test_the_layout_page_names_every_module_of_ddp():
    """ddp/__init__.py points to docs/layout.md for its modules, so the page must name each one."""
    layout = (REPO / "docs" / "layout.md").read_text()
    unnamed = [str(path.relative_to(REPO)) for path in sorted((REPO / "ddp").rglob("*.py"))
               if path.name != "__init__.py" and f"`{path.relative_to(REPO)}`" not in layout]
    assert not unnamed, f"docs/layout.md doesn't name {unnamed}"


def code_lines(page: Path) -> list[tuple[int, str]]:
    """The lines of the page's ```bash blocks with their line numbers, continuations joined and
    comments dropped."""
    lines, fenced, joined, start = [], False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced and line.strip() == "```bash"
            continue
        if fenced:
            start = start or number
            joined += line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if joined.endswith("\\"):
                joined = joined[:-1]
            else:
                if joined.strip():
                    lines.append((start, joined.strip()))
                joined, start = "", 0
    return lines


def adding_section_lines(page: Path) -> set[int]:
    """The line numbers of the README's "Adding a ..." sections and of docs/tasks.md's "Adding a task": their
    commands use the files they show, and tests/test_readme_examples.py and tests/test_tasks.py run them
    for real in a copy of the repository."""
    numbers, inside = set(), False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.startswith("## "):
            inside = page.name in ("README.md", "tasks.md") and line.startswith("## Adding a ")
        if inside:
            numbers.add(number)
    return numbers


def train_commands() -> list[tuple[str, list[str]]]:
    """Each documented launch of train.py (or of the sbatch script that runs it) and its overrides.
    Those with a `<placeholder>` are left out; a `...` ("and more") is dropped."""
    found = []
    for page in pages():
        examples = adding_section_lines(page)
        for number, line in code_lines(page):
            words = shlex.split(line)
            scripts = [i for i, word in enumerate(words) if word.endswith(("train.py", ".sbatch"))]
            if not scripts or "<" in line or number in examples:
                continue
            args = words[scripts[0] + 1:]
            found.append((f"{page.relative_to(REPO)}:{number}", [a for a in args if a != "..."]))
    return found


def first_of_each_sweep(args: list[str]) -> list[str]:
    """The overrides of a multirun's first job; Hydra's own (`hydra.*`, `hydra/...`) are the launcher's."""
    overrides = [a for a in args if "=" in a and not a.startswith("-") and not a.startswith("hydra")]
    first = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            first.append(f"{override.get_key_element()}={next(override.sweep_string_iterator())}")
        else:
            first.append(override.input_line)
    return first


@pytest.mark.parametrize("args", [pytest.param(args, id=where) for where, args in train_commands()])
def test_documented_command_composes(args):
    """Every key, group and option a documented command sets exists and takes its value."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        compose("config", overrides=first_of_each_sweep(args))


def test_documented_make_targets_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    missing = []
    for page in pages():
        spans = [span for line in prose_lines(page) for span in re.findall(r"`([^`]*)`", line)]
        code = spans + [line for _, line in code_lines(page)]
        for target in {t for snippet in code for t in re.findall(r"(?:^|\s)make ([a-z][a-z-]*)", snippet)}:
            if target not in targets:
                missing.append(f"{page.relative_to(REPO)}: make {target}")
    assert not missing, missing
    assert len(train_commands()) > 20  # the extraction above sees the documented commands
