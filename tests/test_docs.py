"""The README stays short and the documentation holds together: every relative link in README.md and docs/ points at
a file (and, for `#anchors`, a heading) that exists, and every page in docs/ is reachable from the README."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a page, in order."""
    blocks, current = [], None
    for line in page.read_text().splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.startswith("```"):
            blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _run_example(code: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``code`` as ``example.py`` in an empty directory, run as a user would (`python example.py`)."""
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_lightning_example_runs_as_written_and_leaves_nothing_behind(tmp_path):
    """docs/lightning.md's example (issue 37.13): 2 CPU ranks under Lightning's DDP, 7 micro-batches per rank and
    epoch, {6: 2, 11: 4} over 12 epochs: 6 x 7 + 5 x ceil(7 / 2) + ceil(7 / 4) optimizer steps, and no
    lightning_logs/ (or anything else) in the directory it ran in."""
    pytest.importorskip("lightning")
    (code,) = _python_blocks(ROOT / "docs" / "lightning.md")
    done = _run_example(code, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("optimizer steps:")]
    assert steps and set(steps) == {f"optimizer steps: {6 * 7 + 5 * 4 + 2}"}, done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example.py"]


def test_the_own_loop_excerpts_are_lines_of_the_example_that_runs():
    """README.md and docs/guide.md show "the heart of" examples/own_loop.py (run by tests/test_examples.py): every
    line they show is a line of that file, so the excerpt cannot drift from what runs."""
    example = {line.strip() for line in (ROOT / "examples" / "own_loop.py").read_text().splitlines()}
    for page in (ROOT / "README.md", ROOT / "docs" / "guide.md"):
        text = page.read_text()
        assert "Runnable as `torchrun --nproc-per-node 2 examples/own_loop.py`; the heart of it:" in text, page
        (code,) = _python_blocks(page)
        missing = [line for line in code.splitlines() if line.strip() and line.strip() not in example]
        assert not missing, f"{page.name}: lines not in examples/own_loop.py: {missing}"
