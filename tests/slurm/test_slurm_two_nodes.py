"""Two nodes of the real SLURM cluster (tests/slurm_cluster.py: two slurmd in their own network namespaces, own
host names and addresses): `accum-sched slurm --nodes 2` runs the demo with one worker per node under both
templates and ends with the model of a local run with the same world size (2), bit for bit; a preempted two-node
job requeues and resumes exactly. The head node comes from `scontrol show hostnames`, the c10d rendezvous
(torchrun) and the gloo group cross addresses."""
from __future__ import annotations

import json

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

TWO_NODES = ("--nodes", "2", "--nproc-per-node", "1")


def _check_spread(slurm, record_dir, restarts=("0",)):  # noqa: F811
    """Each run of the job had rank 0 on the first node and rank 1 on the second, each the only worker there."""
    first, second = slurm.nodes
    seen = recorded_env(record_dir)
    assert [(r["restart"], r["RANK"], r["host"]) for r in seen] == \
        [(k, rank, host) for k in restarts for rank, host in (("0", first), ("1", second))], seen
    for r in seen:
        assert (r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) == ("0", "2", "1", first)


def test_two_nodes_demo_matches_local_run_under_both_templates(slurm, demo_reference, tmp_path):  # noqa: F811
    jobs = {}
    for template in ("torchrun", "per_task"):  # both at once: each takes one core of each node
        cwd = tmp_path / template
        cwd.mkdir()
        jobs[template] = (cwd, submit(slurm, cwd, *TWO_NODES, "--template", template, probe=True))
    for template, (cwd, job_id) in jobs.items():
        run_dir = cwd / "runs" / "demo"
        info = slurm.wait_job(job_id, timeout=900)
        log = job_log(run_dir, job_id)
        assert (info["JobState"], info["ExitCode"], info["NumNodes"]) == ("COMPLETED", "0:0", "2"), log[-3000:]
        assert f"accum-sched: job {job_id} (restart 0) on accnode[1-2]" in log
        if template == "torchrun":
            assert f"rendezvous {slurm.nodes[0]}:" in log
        assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
        _check_spread(slurm, cwd / "env")
        assert same_model(load_model(run_dir / "model.pt"), demo_reference), template


def test_two_nodes_preempted_job_requeues_and_resumes_exactly(slurm, demo_reference, tmp_path):  # noqa: F811
    job_id = submit(slurm, tmp_path, *TWO_NODES, probe=True)  # the torchrun template: c10d across the nodes
    run_dir = tmp_path / "runs" / "demo"
    wait_for_training(slurm, run_dir, job_id)
    slurm.run("scancel", "--signal=USR2", job_id)

    info = slurm.wait_job(job_id, timeout=900)
    log = job_log(run_dir, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    assert f"accum-sched: job {job_id} (restart 1) on accnode[1-2]" in log
    check_preempted_and_resumed(log, run_dir, job_id)
    _check_spread(slurm, tmp_path / "env", restarts=("0", "1"))
    assert same_model(load_model(run_dir / "model.pt"), demo_reference)
