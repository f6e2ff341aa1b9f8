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


def _python_blocks(page: Path, language: str = "python") -> list[str]:
    """The ```python (or other ``language``) blocks of a page, in order."""
    blocks, current = [], None
    for line in page.read_text().splitlines():
        if current is None and line.strip() == "```" + language:
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
        code = _python_blocks(page)[0]  # the page's first block (guide.md's second: the backend= example below)
        missing = [line for line in code.splitlines() if line.strip() and line.strip() not in example]
        assert not missing, f"{page.name}: lines not in examples/own_loop.py: {missing}"


def _excerpt_lines_missing(page: Path, example: Path, block: int = 0) -> list[str]:
    """Lines of ``page``'s python block number ``block`` that are not lines of ``example`` (indentation aside)."""
    lines = {line.strip() for line in example.read_text().splitlines()}
    code = _python_blocks(page)[block]
    return [line for line in code.splitlines() if line.strip() and line.strip() not in lines]


def _printed(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_stream_example_runs_as_written(tmp_path):
    """docs/data.md: 37 samples in micro-batches of 4 are 10 micro-batches without a len(); {0: 1, 1: 4} steps
    10 times in epoch 0 and ceil(10 / 4) = 3 times in epoch 1, whose last window is the 2 micro-batches (4 + 1
    samples) the stream's end left."""
    code = _python_blocks(ROOT / "docs" / "data.md")[0]
    assert _printed(_run_example(code, tmp_path)) == [
        "epoch 0: factor 1, 10 optimizer steps so far", "epoch 1: factor 4, 13 optimizer steps so far",
        "last window: 2 micro-batches, 5 samples"]
    text = (ROOT / "docs" / "data.md").read_text()
    assert "`epoch 1: factor 4, 13 optimizer steps so far`" in text
    assert "`last window: 2 micro-batches, 5 samples`" in text


def test_the_invariant_sampler_example_steps_on_windows_of_the_global_batch(tmp_path):
    """docs/data.md's invariant-sampler script: 29 samples in windows of 12 are steps of 12, 12 and 5 samples in
    each of 2 epochs (one process here; tests/accum_sched/test_invariant_ddp.py checks the ranks)."""
    (code,) = [block for block in _python_blocks(ROOT / "docs" / "data.md") if "InvariantBatchSampler" in block]
    assert _printed(_run_example(code, tmp_path)) == [f"step {i + 1}: {n} samples"
                                                      for i, n in enumerate([12, 12, 5] * 2)]
    assert "`step 1: 12 samples` ... `step 6: 5 samples`" in (ROOT / "docs" / "data.md").read_text()


def test_the_adaptive_example_starts_at_min_factor_and_follows_the_noise_scale(tmp_path):
    """docs/adaptive.md: one line per optimizer step (factor, noise scale, reason); the first 10 steps at
    min_factor 2, the decision at step 10 moves the factor within [2, 16], and every later factor is one a decision
    named; the line the page quotes is one the script prints."""
    (code,) = _python_blocks(ROOT / "docs" / "adaptive.md")
    rows = [line.split(" ", 2) for line in _printed(_run_example(code, tmp_path))]
    assert len(rows) > 12 and all(len(row) == 3 for row in rows), rows[:3]
    assert [(row[0], row[2]) for row in rows[:10]] == [("2", "initial: min_factor 2")] * 10
    assert rows[10][2].startswith("step 10: 2 -> ") and 2 < int(rows[10][0]) <= 16, rows[10]
    for factor, _, reason in rows[10:]:
        assert 2 <= int(factor) <= 16 and (f"-> {factor}:" in reason or f"keep {factor}:" in reason), reason
    assert all(float(row[1]) > 0 for row in rows[1:])
    text = (ROOT / "docs" / "adaptive.md").read_text()
    quoted = text.split("e.g. `", 1)[1].split("`", 1)[0]
    first, second = quoted.split("... ", 1)
    assert any(f"{r[0]} {r[1]}".startswith(first) and r[2] == second for r in rows), quoted


def test_the_own_loop_resume_excerpt_is_the_example_that_runs(tmp_path):
    """docs/resume.md shows the heart of examples/resume_own_loop.py; run in an empty directory, the resumed run
    loads only the 4 micro-batches (32 samples) after the stop and ends with the uninterrupted run's parameters."""
    page, example = ROOT / "docs" / "resume.md", ROOT / "examples" / "resume_own_loop.py"
    assert "Runnable as\n`python examples/resume_own_loop.py` (one process); the heart of it:" in page.read_text()
    assert not _excerpt_lines_missing(page, example)
    printed = _printed(_run_example(example.read_text(), tmp_path))
    assert printed == ["stopped at epoch 1, micro-batch 8", "the resumed run loaded 32 samples",
                       "same parameters as the uninterrupted run: True"]
    assert all(f"`{line}`" in page.read_text() for line in printed)


def _run_on_two_ranks(code: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``code`` as ``example.py`` in an empty directory, run as the page says: torchrun --nproc-per-node 2."""
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


TWO_RANK_PAGES = ("fsdp.md", "deepspeed.md", "training.md")


@pytest.mark.parametrize("page", TWO_RANK_PAGES)
def test_the_two_rank_examples_are_whole_scripts_the_page_says_how_to_run(page):
    """The fast tier's check of the pages whose script needs torchrun (run by the slow tests below): the block is a
    whole script (it parses, imports what it uses, sets up its process group) and the text gives the command."""
    text = (ROOT / "docs" / page).read_text()
    assert "(a complete script: `torchrun --nproc-per-node 2 example.py` on CPU, gloo):\n\n```python" in text
    (code,) = [block for block in _python_blocks(ROOT / "docs" / page) if "init_process_group" in block]
    compile(code, page, "exec")
    assert code.startswith("import ") and 'dist.init_process_group("gloo")\nmain()\n' in code


@pytest.mark.slow
def test_the_fsdp_example_shards_the_model_and_steps_on_its_schedule(tmp_path):
    """docs/fsdp.md: 8 epochs of 4 micro-batches per rank, {0: 1, 5: 2}: 5 x 4 + 3 x 2 optimizer steps on both
    ranks, and each rank holds a part of the 833 parameter elements, the parts adding up to the whole."""
    (code,) = _python_blocks(ROOT / "docs" / "fsdp.md")
    done = _run_on_two_ranks(code, tmp_path)
    # both ranks print to one pipe: a line may start after the other rank's text, so find each report anywhere
    reports = sorted(re.findall(r"rank (\d): (\d+) optimizer steps, holds (\d+) of (\d+) parameter elements",
                                "\n".join(_printed(done))))
    assert [(rank, steps, total) for rank, steps, _, total in reports] == [("0", "26", "833"), ("1", "26", "833")], \
        done.stdout[-3000:]
    held = [int(part) for _, _, part, _ in reports]
    assert sum(held) == 833 and 0 < min(held), reports
    assert f"({held[0]} and {held[1]} here" in (ROOT / "docs" / "fsdp.md").read_text()


@pytest.mark.slow
def test_the_deepspeed_example_steps_on_its_schedule_and_consolidates(tmp_path):
    """docs/deepspeed.md: ZeRO-2 on 2 ranks, 4 micro-batches per rank and epoch, {0: 1, 5: 2, 10: 4} over 12
    epochs: 5 x 4 + 5 x 2 + 2 x 1 optimizer steps; rank 0's consolidated state_dict has the plain model's keys."""
    pytest.importorskip("deepspeed")
    (code,) = _python_blocks(ROOT / "docs" / "deepspeed.md")
    lines = [line for line in _printed(_run_on_two_ranks(code, tmp_path)) if "optimizer steps" in line]
    assert lines == ["32 optimizer steps; state_dict: ['0.bias', '0.weight', '2.bias', '2.weight']"]


@pytest.mark.slow
def test_the_compile_example_saves_the_bare_modules_keys(tmp_path):
    """docs/training.md: torch.compile inside DDP on 2 ranks, {0: 1, 2: 2, 4: 4} over 6 epochs of 4 micro-batches:
    8 + 4 + 2 optimizer steps, and model.pt's keys carry no _orig_mod. prefix."""
    (code,) = [b for b in _python_blocks(ROOT / "docs" / "training.md") if "torch.compile" in b]
    lines = [line for line in _printed(_run_on_two_ranks(code, tmp_path)) if "optimizer steps" in line]
    assert lines == ["14 optimizer steps; model.pt keys: ['0.bias', '0.weight', '2.bias', '2.weight']"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example.py", "model.pt"]


@pytest.mark.slow
def test_the_hf_export_example_opens_what_hf_tiny_wrote(tmp_path):
    """docs/hf.md: after `accum-sched run configs/hf_tiny.yaml` (here one epoch, its outputs in the empty directory
    the script then runs in), the script opens runs/hf_tiny/hf, finds its 53 model.pt tensors equal, and writes
    on from "The "."""
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-m", "launcher", "run", "configs/hf_tiny.yaml", "--set", "run.epochs=1",
                          "--set", f"run.output_dir={tmp_path / 'runs' / 'hf_tiny'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (code,) = _python_blocks(ROOT / "docs" / "hf.md")
    printed = _printed(_run_example(code, tmp_path))
    assert printed[0] == "53 tensors of model.pt, all equal in hf/: True"
    assert printed[1].startswith("'The ") and len(printed) == 2, printed


def test_the_backend_interface_excerpt_is_the_example_that_runs(tmp_path):
    """docs/backends.md shows the heart of examples/drive_a_backend.py, which drives a back end through one window
    in the engine's order; run in an empty directory, its step equals plain torch's large-batch SGD step."""
    page, example = ROOT / "docs" / "backends.md", ROOT / "examples" / "drive_a_backend.py"
    assert "Runnable as `python examples/drive_a_backend.py`" in page.read_text()
    assert not _excerpt_lines_missing(page, example)
    printed = _printed(_run_example(example.read_text(), tmp_path))
    assert printed[0].startswith("window totals: 10 elements, 10 samples, loss sum ")
    assert printed[1:] == ["one optimizer step equals the large-batch reference: True",
                           "gradient cleared after the step: True"]
    assert f"`{printed[1]}`" in page.read_text()


def test_the_yaml_examples_pass_accum_sched_check(tmp_path, monkeypatch, capsys):
    """README.md's config is whole: `accum-sched check` takes it as written. Every other ```yaml block on a page is
    a few sections of a config: each section replaces configs/demo.yaml's and `check` takes the result (the files
    the stream example names exist in the directory it runs in, configs/ is the project's)."""
    import yaml

    from launcher.cli import main

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a line of text\n")
    (tmp_path / "data" / "extra.jsonl").write_text('{"text": "another"}\n')
    monkeypatch.chdir(tmp_path)
    (readme_config,) = _python_blocks(ROOT / "README.md", "yaml")
    (tmp_path / "readme.yaml").write_text(readme_config)
    assert main(["check", "readme.yaml", "--batches-per-epoch", "32"]) == 0, capsys.readouterr()
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    refused = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for number, block in enumerate(_python_blocks(page, "yaml")):
            (tmp_path / "snippet.yaml").write_text(yaml.safe_dump({**demo, **yaml.safe_load(block)}))
            capsys.readouterr()
            if main(["check", "snippet.yaml", "--batches-per-epoch", "8"]) != 0:
                refused.append(f"{page.name} yaml block {number + 1}: {capsys.readouterr().err.strip()}")
    assert not refused, "\n".join(refused)


def test_the_guides_backend_example_runs_as_written(tmp_path):
    """docs/guide.md's second block: a back end built by hand and given as backend=; {0: 1, 1: 2} over two epochs
    of 5 micro-batches is 5 + 3 optimizer steps."""
    code = _python_blocks(ROOT / "docs" / "guide.md")[1]
    assert "backend=backend" in code
    assert _printed(_run_example(code, tmp_path)) == ["optimizer steps: 8"]


@pytest.mark.parametrize("page,example", [("transformers.md", "hf_trainer.py"),
                                          ("accelerate.md", "accelerate_loop.py")])
def test_the_hugging_face_excerpts_are_lines_of_the_examples_that_run(page, example):
    """docs/transformers.md and docs/accelerate.md show the heart of an examples/ file (tests/accum_sched/
    test_transformers.py and test_accelerate.py run both files under torchrun): every line shown is one of its."""
    assert f"examples/{example}" in (ROOT / "docs" / page).read_text()
    assert not _excerpt_lines_missing(ROOT / "docs" / page, ROOT / "examples" / example)


# Every ```python block of the documentation and the test above that runs it (or checks it line by line against the
# example file that one runs): a block added to a page must be added here, with its test.
PYTHON_BLOCKS = {
    "README.md": 1, "guide.md": 2,  # examples/own_loop.py's excerpt (tests/test_examples.py runs the file); guide.md's
    # second block is the backend= script
    "transformers.md": 1, "accelerate.md": 1,  # excerpts of examples/hf_trainer.py, examples/accelerate_loop.py
    "lightning.md": 1, "data.md": 2, "adaptive.md": 1, "fsdp.md": 1, "deepspeed.md": 1, "training.md": 1,
    "hf.md": 1,  # whole scripts (data.md: the stream script and the invariant-sampler script)
    "resume.md": 1, "backends.md": 1,  # excerpts of examples/resume_own_loop.py, examples/drive_a_backend.py
}


def test_every_python_block_is_one_a_test_runs():
    found = {page.name: len(_python_blocks(page)) for page in _pages() if _python_blocks(page)}
    assert found == PYTHON_BLOCKS, "a python block no test runs: add a test for it (whole script or excerpt)"


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
    """The README's second command is the fast tier, and CI runs exactly that text before the slow tier."""
    command = (ROOT / "README.md").read_text().splitlines()[4]
    assert command.endswith('.venv/bin/python -m pytest -q -m "not slow" -n 2 --dist loadfile'), command
    ci = (ROOT / ".ci" / "run").read_text()
    lines = ci.splitlines()
    readme_line = next((i for i, line in enumerate(lines) if line.startswith(command)), None)
    assert readme_line is not None, ".ci/run does not run the README's test command as written"
    slow = next((i for i, line in enumerate(lines) if "pytest -q -m slow " in line and "--durations=25" in line), None)
    assert slow is not None and slow > readme_line, ".ci/run must run the slow tier after the README command"
