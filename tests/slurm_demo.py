"""What the SLURM end-to-end tests share: the demo trained locally (the model every SLURM run of it must equal,
bit for bit), submitting it with `accum-sched slurm`, reading the job's log, and the probe task that records the
launch variables each worker sees."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
DEMO = ROOT / "configs" / "demo.yaml"
DEMO_STEPS = 448  # configs/demo.yaml on 2 workers: 12 epochs of 64 micro-batches, factors 1, 2, 4
# the probe task (tests/probe_tasks.py) builds the demo's model and data, and records each worker's variables
PROBE = "probe_tasks:regression_recording_env"


def load_model(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def same_model(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Computed once per session: every module that imports the fixture gets its own definition of it.
_REFERENCE: dict = {}


@pytest.fixture(scope="session")
def demo_reference(tmp_path_factory) -> dict:
    """The demo trained locally by `accum-sched run` (torchrun, 2 workers): the model every SLURM run must equal,
    on one node (2 workers) or two (1 worker each)."""
    if "model" not in _REFERENCE:
        out = tmp_path_factory.mktemp("reference") / "demo"
        done = subprocess.run([sys.executable, "-m", "launcher", "run", str(DEMO), "--set", f"run.output_dir={out}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        _REFERENCE["model"] = load_model(out / "model.pt")
    return _REFERENCE["model"]


def check_preempted_and_resumed(log: str, run_dir: Path, job_id: str) -> int:
    """The job's log shows one mid-run stop and its resume from that step's checkpoint; returns the step.

    Rank 0 prints its "preempted at step N" line before `scontrol requeue` (which may end the job step at once), so
    the line must be there, and the requeued run must resume from that very step."""
    where = re.escape(str(run_dir))
    resumed = re.findall(rf"accum-sched: resumed from {where}/checkpoints/step-(\d+)(?:-mb\d+)? ", log)
    assert len(resumed) == 1 and 0 < int(resumed[0]) < DEMO_STEPS, log[-4000:]  # really mid-run
    step = int(resumed[0])
    stopped = re.findall(r"accum-sched: preempted at step (\d+): checkpoint saved ", log)
    assert stopped == [str(step)], log[-4000:]
    assert f"accum-sched: job {job_id} (restart 1)" in log
    assert log.count(f"accum-sched: done: {DEMO_STEPS} optimizer steps") == 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, DEMO_STEPS + 1))  # each step logged once across both runs
    return step


def submit_env(slurm) -> dict:
    """The cluster's client environment with tests/ importable (the probe task), passed on to the job."""
    paths = [str(ROOT), str(TESTS)] + [p for p in slurm.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(slurm.env, PYTHONPATH=os.pathsep.join(paths))


def submit(slurm, cwd: Path, *args: str, probe: bool = False) -> str:
    """`accum-sched slurm configs/demo.yaml ARGS` from `cwd`; the job id."""
    record = json.dumps({"record_dir": str(cwd / "env")})
    extra = ["--set", f"task.target={PROBE}", "--set", f"task.args={record}"] if probe else []
    done = subprocess.run([sys.executable, "-m", "launcher", "slurm", str(DEMO), *args, *extra], cwd=cwd,
                          env=submit_env(slurm), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.match(r"submitted batch job (\d+): ", done.stdout)
    assert m, done.stdout
    return m.group(1)


def job_log(run_dir: Path, job_id: str) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_training(slurm, run_dir: Path, job_id: str, timeout: float = 300) -> None:
    """Until the job's log shows a progress line (training under way); fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while not re.search(rf"step \d+/{DEMO_STEPS}", job_log(run_dir, job_id)):
        assert time.monotonic() < deadline, job_log(run_dir, job_id)[-3000:]
        assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), job_log(run_dir, job_id)[-3000:]
        time.sleep(0.05)


def recorded_env(record_dir: Path) -> list[dict]:
    """The probe task's records, one per worker start, by rank."""
    rows = [json.loads(p.read_text()) for p in sorted(record_dir.glob("env-*.json"))]
    return sorted(rows, key=lambda r: (int(r["restart"]), int(r["RANK"])))
