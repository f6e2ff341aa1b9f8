"""End to end against the real SLURM cluster (tests/slurm_cluster.py), on one node: `accum-sched slurm` submits the
demo (2 workers) and it ends with the same model as a local `accum-sched run`; a job preempted mid-run with
`scancel --signal=USR2` checkpoints, requeues itself, resumes, and ends with that same model. Under the per_task
template every srun task sees the torchelastic variables of its rank (LOCAL_RANK included) where DeepSpeed would
start. Two nodes: test_slurm_two_nodes.py."""
from __future__ import annotations

import json
import math

import pytest

from slurm_demo import (  # noqa: F401
    check_preempted_and_resumed,
    demo_reference,
    job_log,
    load_model,
    recorded_env,
    same_model,
    submit,
    wait_for_training,
)

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

SCHEDULE = {0: 1, 4: 2, 8: 4}  # configs/demo.yaml
BATCHES_PER_EPOCH = 64  # 2048 samples / 2 ranks / micro-batch 16


def test_demo_job_completes_with_the_local_runs_model(slurm, demo_reference, tmp_path):  # noqa: F811
    job_id = submit(slurm, tmp_path)
    run_dir = tmp_path / "runs" / "demo"
    info = slurm.wait_job(job_id, timeout=600)
    log = job_log(run_dir, job_id)
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
    assert same_model(load_model(run_dir / "model.pt"), demo_reference)


@pytest.mark.parametrize("template", ["torchrun", "per_task"])
def test_preempted_job_requeues_resumes_and_ends_with_the_same_model(slurm, demo_reference, tmp_path,  # noqa: F811
                                                                      template):
    job_id = submit(slurm, tmp_path, "--template", template, probe=True)
    run_dir = tmp_path / "runs" / "demo"
    wait_for_training(slurm, run_dir, job_id)  # preempt once training is under way
    slurm.run("scancel", "--signal=USR2", job_id)

    info = slurm.wait_job(job_id, timeout=600)
    log = job_log(run_dir, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    check_preempted_and_resumed(log, run_dir, job_id)
    assert same_model(load_model(run_dir / "model.pt"), demo_reference)

    # What each worker process saw, in both runs of the job: its own rank and local rank, exported by the worker
    # itself under per_task (srun sets only SLURM_*), by torchrun's agent under torchrun.
    seen = recorded_env(tmp_path / "env")
    assert [(r["restart"], r["RANK"], r["LOCAL_RANK"]) for r in seen] == \
        [("0", "0", "0"), ("0", "1", "1"), ("1", "0", "0"), ("1", "1", "1")]
    for r in seen:  # a requeued run may land on the other node: one host per run
        host = next(o["host"] for o in seen if o["restart"] == r["restart"])
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["host"]) == ("2", "2", host)
        assert r["MASTER_ADDR"] and r["MASTER_PORT"]
        if template == "per_task":  # srun's own numbering is the one exported
            assert (r["SLURM_PROCID"], r["SLURM_LOCALID"]) == (r["RANK"], r["LOCAL_RANK"])
            assert r["MASTER_ADDR"] == r["host"]
