"""The README stays short and the documentation holds together: every relative link in README.md and docs/ points at
a file (and, for `#anchors`, a heading) that exists, and every page in docs/ is reachable from the README."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    in_code = False
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(_anchor(line))
    return found


def _links(page: Path):
    in_code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(line):
            if not target.startswith(("http://", "https://", "mailto:")):
                yield number, target


def test_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference material to docs/"
    assert lines[2:4] and all(".venv/bin/" in line for line in lines[3:5]), "the two fresh-machine commands come first"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for number, target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    orphans = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not orphans, f"docs pages not linked from README.md: {orphans}"


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
    """The README's second command is the fast tier, and CI runs exactly that text before the slow tier."""
    command = (ROOT / "README.md").read_text().splitlines()[4]
    assert command.endswith('.venv/bin/python -m pytest -q -m "not slow"'), command
    ci = (ROOT / ".ci" / "run").read_text()
    lines = ci.splitlines()
    readme_line = next((i for i, line in enumerate(lines) if line.startswith(command)), None)
    assert readme_line is not None, ".ci/run does not run the README's test command as written"
    slow = next((i for i, line in enumerate(lines) if "pytest -q -m slow --durations=25" in line), None)
    assert slow is not None and slow > readme_line, ".ci/run must run the slow tier after the README command"
