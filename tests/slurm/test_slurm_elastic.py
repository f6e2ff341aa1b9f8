"""docs/elastic.md's SLURM recipe on the real two-node cluster (tests/slurm_cluster.py): an sbatch script of two
nodes starts one elastic agent per node with `srun --ntasks-per-node=1 --no-kill accum-sched run CONFIG --nnodes
1:$SLURM_JOB_NUM_NODES --rdzv-endpoint "$head:PORT" --max-restarts 3`, the head node from `scontrol show
hostnames`. After step 5 on 2 workers node 2's agent and its workers are SIGKILLed (found on the host's /proc: the
nodes are network namespaces of this host); node 1's agent re-forms the group alone, continues from the newest
checkpoint with the factor doubled and ends allclose to the plain-torch reference of the loopback kill test
(tests/launcher/launch/test_elastic_run.py, whose config, helpers and reference this file reuses)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time

import pytest

import paths

sys.path.insert(0, os.path.join(paths.TESTS, "launcher", "launch"))
from test_elastic_run import DELAY_S, RDZV_CONF, Agents, finished_like_the_reference  # noqa: E402

from slurm_demo import submit_env  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

JOB_S = 600  # the whole job, start-up of both nodes' workers under load included

SCRIPT = """#!/bin/bash
#SBATCH --job-name=elastic
#SBATCH --nodes=2
#SBATCH --output={out}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --ntasks-per-node=1 --no-kill {accum_sched} run {cfg} --nnodes 1:$SLURM_JOB_NUM_NODES \\
     --rdzv-endpoint "$head:{port}" --max-restarts 3 --rdzv-conf {rdzv_conf}
"""


def _accum_sched() -> str:
    """The `accum-sched` entry point of this Python (the recipe's command); `python -m launcher` where the package
    is not installed (the same CLI)."""
    found = shutil.which("accum-sched", path=os.path.dirname(sys.executable))
    return found or f"{sys.executable} -m launcher"


def _proc(pid: str, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def _job_processes(job_id: str, node: str | None = None) -> list[int]:
    """The host's processes of the job's srun step (their environment says so), on ``node`` or any node."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        env = _proc(pid, "environ").split(b"\0")
        if f"SLURM_JOB_ID={job_id}".encode() in env and b"SLURM_STEP_ID=0" in env and \
                (node is None or f"SLURMD_NODENAME={node}".encode() in env):
            pids.append(int(pid))
    return pids


def _kill_agent_on(job_id: str, node: str, cfg: str) -> list[int]:
    """SIGKILL the agent on ``node`` (the `accum-sched run` with the run's config on its command line) and every
    process of the step there (torchrun, the worker): the node is lost at once. Returns the pids killed."""
    step = _job_processes(job_id, node)
    agents = [p for p in step if cfg.encode() in _proc(str(p), "cmdline")]
    assert agents, f"no agent of job {job_id} on {node}: {step}"
    for pid in agents + [p for p in step if p not in agents]:  # the agent first: nothing of it restarts a worker
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return step


def test_the_documented_slurm_recipe_survives_a_lost_node_exactly(slurm, tmp_path):
    agents = Agents(str(tmp_path), "1:2")  # writes the kill test's config; the agents are srun's here
    log = tmp_path / "slurm.out"
    script = tmp_path / "elastic.sbatch"
    script.write_text(SCRIPT.format(out=log, accum_sched=_accum_sched(), cfg=agents.cfg, port=agents.port,
                                    rdzv_conf=RDZV_CONF))
    env = dict(submit_env(slurm), ELASTIC_DELAY_S=DELAY_S)  # sbatch passes the environment on to the job
    done = slurm.run("sbatch", str(script), cwd=paths.TESTS, env=env, timeout=60)
    job_id = re.match(r"Submitted batch job (\d+)", done.stdout).group(1)
    deadline = time.monotonic() + JOB_S
    try:
        def both_past_step_5():
            assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), log.read_text()[-3000:]
            return any(m["step"] >= 5 and m["factor"] == 3 for m in agents.metrics())  # 48 / (8 x 2 workers)

        agents.wait_until("step 5 on 2 workers", both_past_step_5, deadline)
        killed_at = time.monotonic()
        killed = _kill_agent_on(job_id, slurm.nodes[1], agents.cfg)
        reformed = None
        while slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING") and time.monotonic() < deadline:
            factors = [m["factor"] for m in agents.metrics()]
            if reformed is None and 6 in factors[factors.index(3):]:
                reformed = time.monotonic() - killed_at
            time.sleep(0.1)
        info = slurm.wait_job(job_id, timeout=max(1.0, deadline - time.monotonic()))
    finally:
        slurm.run("scancel", job_id, check=False)
    said = log.read_text(errors="replace")
    assert f"srun: error: {slurm.nodes[1]}: task 1: Killed" in said, said[-4000:]  # SLURM saw node 2's task die
    assert said.count("accum-sched: done: 18 optimizer steps") == 1, said[-4000:]  # node 1's agent finished it
    # the step's (and job's) status is the lost task's, though the run finished: check summary.json, not the job
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "137:0"), info
    metrics = finished_like_the_reference(agents, world=1)
    factors = [m["factor"] for m in metrics]
    assert 3 in factors and factors[-1] == 6, factors  # 2 workers on 2 nodes, then node 1 alone at factor 6
    assert reformed is not None, factors
    assert _job_processes(job_id) == [], "processes of the job left behind"
    print(f"job {job_id}: {info['JobState']} {info['ExitCode']}; killed {len(killed)} processes on "
          f"{slurm.nodes[1]}; SIGKILL to the first step of node 1's 1-worker group {reformed:.1f} s")
