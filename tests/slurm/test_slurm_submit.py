"""`accum-sched slurm` applies `accum-sched run`'s checkpoint policy at submission, against the real controller
(jobs are submitted held, `--hold`, so nothing trains): a fresh submission moves an earlier run's checkpoints
aside and its script does not resume; `--resume` keeps them and is checked before anything is queued (another
config is exit 2, nothing submitted); a failed sbatch puts moved checkpoints back. No torch in these processes:
the checkpoints are committed by launcher.checkpoint.store with a placeholder state file, which is all the
submission reads (manifest, checksums, config hash, world size)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paths
from earlier_runs import earlier_run
from launcher.checkpoint import store

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

ROOT = paths.ROOT_PATH
DEMO = ROOT / "configs" / "demo.yaml"
HOLD = ["--set", 'slurm.extra_sbatch=["--hold"]']


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _slurm_cli(cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "slurm", str(DEMO), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _job_id(done) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split("submitted batch job ")[1].split(":")[0]


def test_fresh_submission_moves_an_earlier_run_aside(slurm, tmp_path):  # noqa: F811
    root = earlier_run(tmp_path)
    done = _slurm_cli(tmp_path, slurm.env, *HOLD)
    job_id = _job_id(done)
    try:
        assert slurm.job(job_id)["JobState"] == "PENDING"  # queued (held), never started
        aside = [n for n in _names(root) if n.startswith("superseded-")]
        assert len(aside) == 1 and _names(root) == aside  # nothing left for the new job to resume
        assert _names(root / aside[0]) == ["step-00000010", "step-00000020"]  # moved, not lost
        assert f"moved 2 checkpoint(s) of an earlier run to {root / aside[0]}" in done.stderr
        script = (tmp_path / "runs" / "demo" / "job.sbatch").read_text()
        assert "\nresume=''\n" in script  # the first run starts afresh; only a requeue resumes
    finally:
        slurm.run("scancel", job_id, check=False)


def test_resume_is_checked_before_queueing_and_keeps_the_checkpoints(slurm, tmp_path):  # noqa: F811
    root = earlier_run(tmp_path, overrides=["optimizer.lr=0.01"])
    before = _names(root)
    queued = slurm.run("squeue", "-h", "-o", "%i").stdout.split()
    other = _slurm_cli(tmp_path, slurm.env, "--resume", *HOLD)
    assert other.returncode == 2, other.stdout + other.stderr
    assert other.stderr.startswith("error: optimizer.lr: is 0.001 but checkpoint ") and "made with 0.01" in \
        other.stderr and other.stderr.count("\n") == 1
    assert slurm.run("squeue", "-h", "-o", "%i").stdout.split() == queued  # nothing submitted
    assert _names(root) == before and not (tmp_path / "runs" / "demo" / "job.sbatch").exists()

    same = tmp_path / "same"
    same.mkdir()
    root = earlier_run(same)
    job_id = _job_id(_slurm_cli(same, slurm.env, "--resume", *HOLD))
    try:
        assert _names(root) == ["step-00000010", "step-00000020"]  # kept for the job to continue
        assert "\nresume=auto\n" in (same / "runs" / "demo" / "job.sbatch").read_text()
    finally:
        slurm.run("scancel", job_id, check=False)
    # a world size the checkpoints were not made with is refused before queueing too
    nodes = _slurm_cli(same, slurm.env, "--resume", "--nodes", "2", *HOLD)
    assert nodes.returncode == 2 and nodes.stderr.startswith("error: checkpoint.on_world_change: "), nodes.stderr


def test_failed_sbatch_puts_moved_checkpoints_back(tmp_path):
    root = earlier_run(tmp_path)
    # the whole submission path (checkpoint policy included) without torch: exit 3 if it got imported
    code = ("import sys; from launcher.cli import main; rc = main(['slurm', %r]); "
            "sys.exit(3 if 'torch' in sys.modules else rc)" % str(DEMO))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PATH="/nonexistent"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "sbatch: command not found" in done.stderr, done.stderr
    assert _names(root) == ["step-00000010", "step-00000020"]  # nothing queued, nothing moved
    assert json.loads((root / "step-00000020" / store.MANIFEST).read_text())["step"] == 20
