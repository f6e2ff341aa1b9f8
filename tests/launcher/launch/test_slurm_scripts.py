"""The ready-to-edit sbatch scripts in the repository's top-level slurm/ folder are exactly what
`accum-sched slurm configs/<name>.yaml --dry-run` renders from a checkout, with the two machine-specific values
written as placeholders: the checkout's path (PLACEHOLDER_ROOT) and the Python interpreter (PLACEHOLDER_PYTHON).
A change to a template, to the rendering or to a shipped config that is not carried into slurm/ fails here.

Regenerate them after an intended change with ACCUM_SCHED_UPDATE_GOLDEN=1 and review the diff."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import paths

SCRIPTS = paths.ROOT_PATH / "slurm"
PLACEHOLDER_ROOT = "/path/to/accum-sched"
PLACEHOLDER_PYTHON = f"{PLACEHOLDER_ROOT}/.venv/bin/python"
# one node (DDP), two nodes (DDP), DeepSpeed: the shipped configs a SLURM user starts from
REQUIRED = ("demo", "two_nodes", "deepspeed")


def portable_dry_run(config: str) -> str:
    """The real command's --dry-run output, run from the checkout's root as a user would, with this machine's
    interpreter and checkout path replaced by the placeholders (the interpreter first: it may live in the
    checkout, as the README's .venv does)."""
    done = subprocess.run([sys.executable, "-m", "launcher", "slurm", f"configs/{config}.yaml", "--dry-run"],
                          cwd=paths.ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": paths.ROOT})
    assert done.returncode == 0, done.stderr
    script = done.stdout.replace(sys.executable, PLACEHOLDER_PYTHON)
    # the command resolves the run directory from its working directory, which the OS reports without symlinks
    for root in sorted({paths.ROOT, os.path.realpath(paths.ROOT)}, key=len, reverse=True):
        script = script.replace(root, PLACEHOLDER_ROOT)
    return script


def test_the_three_configs_have_a_script_and_every_script_a_config():
    names = sorted(p.stem for p in SCRIPTS.glob("*.sbatch"))
    assert set(REQUIRED) <= set(names), f"slurm/ lacks {sorted(set(REQUIRED) - set(names))}"
    assert [n for n in names if not (paths.ROOT_PATH / "configs" / f"{n}.yaml").is_file()] == []
    assert (SCRIPTS / "README.md").is_file()


@pytest.mark.parametrize("name", REQUIRED)
def test_script_is_what_dry_run_renders(name):
    path = SCRIPTS / f"{name}.sbatch"
    rendered = portable_dry_run(name)
    if os.environ.get("ACCUM_SCHED_UPDATE_GOLDEN") == "1":
        path.write_text(rendered)
    committed = path.read_text()
    assert committed == rendered, f"{path} differs from `accum-sched slurm configs/{name}.yaml --dry-run` " \
                                  f"(see this module's docstring)"
    # nothing of this machine left in it, the placeholders present where a user edits, and bash parses it
    assert paths.ROOT not in committed and sys.executable not in committed
    assert f"#SBATCH --chdir={PLACEHOLDER_ROOT}\n" in committed and f"{PLACEHOLDER_PYTHON} -m " in committed
    assert subprocess.run(["bash", "-n"], input=committed, text=True).returncode == 0
