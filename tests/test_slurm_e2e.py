"""End to end against the real SLURM controller (tests/slurm_cluster.py): `accum-sched slurm` submits the demo
(2 workers) and it ends with the same model as a local `accum-sched run`; a job preempted mid-run with
`scancel --signal=USR2` checkpoints, requeues itself, resumes, and ends with that same model."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slurm_cluster import slurm  # noqa: F401  (the session fixture)

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"
SCHEDULE = {0: 1, 4: 2, 8: 4}  # configs/demo.yaml
BATCHES_PER_EPOCH = 64  # 2048 samples / 2 ranks / micro-batch 16


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _same_model(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The demo trained locally by `accum-sched run` (torchrun, 2 workers): the model every SLURM run must equal."""
    out = tmp_path_factory.mktemp("reference") / "demo"
    done = subprocess.run([sys.executable, "-m", "launcher", "run", str(DEMO), "--set", f"run.output_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return _load(out / "model.pt")


def _submit(slurm, cwd: Path, *args: str) -> str:  # noqa: F811
    done = subprocess.run([sys.executable, "-m", "launcher", "slurm", str(DEMO), *args], cwd=cwd, env=slurm.env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.match(r"submitted batch job (\d+): ", done.stdout)
    assert m, done.stdout
    return m.group(1)


def _log(run_dir: Path, job_id: str) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_demo_job_completes_with_the_local_runs_model(slurm, reference, tmp_path):  # noqa: F811
    job_id = _submit(slurm, tmp_path)
    run_dir = tmp_path / "runs" / "demo"
    info = slurm.wait_job(job_id, timeout=600)
    log = _log(run_dir, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert f"accum-sched: job {job_id} (restart 0)" in log
    # the script and the resolved config (with the run directory made absolute) are in the run directory
    assert (run_dir / "job.sbatch").is_file()
    assert f"output_dir: {run_dir}" in (run_dir / "config.yaml").read_text()

    summary = json.loads((run_dir / "summary.json").read_text())
    factor = {e: SCHEDULE[max(s for s in SCHEDULE if s <= e)] for e in range(12)}
    steps_per_epoch = {e: math.ceil(BATCHES_PER_EPOCH / f) for e, f in factor.items()}
    assert (summary["world_size"], summary["optimizer_steps"]) == (2, sum(steps_per_epoch.values()))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for epoch, steps in steps_per_epoch.items():
        mine = [r for r in rows if r["epoch"] == epoch]
        assert len(mine) == steps and {r["factor"] for r in mine} == {factor[epoch]}, epoch
    assert _same_model(_load(run_dir / "model.pt"), reference)


@pytest.mark.parametrize("template", ["torchrun", "per_task"])
def test_preempted_job_requeues_resumes_and_ends_with_the_same_model(slurm, reference, tmp_path,  # noqa: F811
                                                                      template):
    job_id = _submit(slurm, tmp_path, "--template", template)
    run_dir = tmp_path / "runs" / "demo"
    # Preempt once training is under way: the first progress line is step 10 of 448.
    deadline = time.monotonic() + 300
    while not re.search(r"step \d+/448", _log(run_dir, job_id)):
        assert time.monotonic() < deadline, _log(run_dir, job_id)[-3000:]
        assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), _log(run_dir, job_id)[-3000:]
        time.sleep(0.05)
    slurm.run("scancel", "--signal=USR2", job_id)

    info = slurm.wait_job(job_id, timeout=600)
    log = _log(run_dir, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    stopped = re.search(r"accum-sched: preempted at step (\d+): checkpoint saved, job requeued", log)
    assert stopped and 0 < int(stopped.group(1)) < 448, log[-4000:]  # really mid-run
    assert f"accum-sched: job {job_id} (restart 1)" in log
    assert log.count("accum-sched: done: 448 optimizer steps") == 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 449))  # each step logged once across both runs
    assert _same_model(_load(run_dir / "model.pt"), reference)
