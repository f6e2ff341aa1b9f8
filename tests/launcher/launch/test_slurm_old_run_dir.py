"""`accum-sched slurm` pointed at an old run directory (issue 28, item 5): it does not resume it unless asked. Without
SLURM: a stand-in `sbatch` on PATH records the submission; the job's own resume decision is the workers'
(launcher/checkpoint/resume.py: plan_resume, with SLURM_RESTART_COUNT as a requeue sets it).

* without --resume the earlier run's checkpoints are moved aside before submission, said on stderr, and the script
  starts afresh; even a requeued attempt of the new job (restart 1, before it saved anything) finds nothing of the
  old run to continue;
* with --resume the checkpoints stay and the script continues from them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import paths
from earlier_runs import earlier_run
from launcher.checkpoint.resume import plan_resume
from launcher.config import load_config

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

DEMO = paths.ROOT_PATH / "configs" / "demo.yaml"
SBATCH = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/submitted"
echo 4242
"""


def _earlier_run(cwd: Path) -> Path:
    root = earlier_run(cwd)
    (cwd / "runs" / "demo" / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


def _slurm(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(SBATCH)
    sbatch.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=paths.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "launcher", "slurm", str(DEMO), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_old_run_dir_is_not_resumed_without_resume(tmp_path):
    root = _earlier_run(tmp_path)
    done = _slurm(tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bin" / "submitted").read_text().split()[-1].endswith("runs/demo/job.sbatch")
    aside = [p for p in root.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(p.name for p in root.iterdir()) == [aside[0].name]
    assert f"moved 2 checkpoint(s) of an earlier run to {aside[0]}" in done.stderr
    assert "submit with --resume to continue a run" in done.stderr
    script = (tmp_path / "runs" / "demo" / "job.sbatch").read_text()
    assert "\nresume=''\n" in script  # the first attempt starts afresh
    # a requeued attempt (SLURM_RESTART_COUNT=1) resumes only checkpoints of this job: there are none yet
    cfg = load_config(str(tmp_path / "runs" / "demo" / "config.yaml"))
    plan = plan_resume(cfg, cfg.world_size, None, restarts=1)
    assert plan.path is None


def test_old_run_dir_is_continued_with_resume(tmp_path):
    root = _earlier_run(tmp_path)
    done = _slurm(tmp_path, "--resume")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010", "step-00000020"]
    assert "\nresume=auto\n" in (tmp_path / "runs" / "demo" / "job.sbatch").read_text()
    assert "moved" not in done.stderr
