"""The README stays a short newcomer's page, and every relative link in it and in docs/ leads
somewhere: to a file of the repository and, with a `#anchor`, to a heading of that file."""
import re
from pathlib import Path

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
    assert {"adding-a-model", "adding-a-dataset", "adding-a-task", "options", "layout"} <= anchors(REPO / "README.md")
    assert slug("`mode=eval` and `resume`") == "modeeval-and-resume"
    assert "elastic-scale-down" in anchors(REPO / "docs" / "fault-tolerance.md")
