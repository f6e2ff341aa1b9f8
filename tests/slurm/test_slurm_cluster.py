"""Against the real two-node SLURM cluster (tests/slurm_cluster.py): launch detection under srun on one node and
across both, the host list syntax as scontrol reads it, and sbatch's own refusals reaching the user. No torch in
these processes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import paths
from launcher.launch.env import expand_nodelist, slurm_port

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

ROOT = paths.ROOT_PATH


def _srun_detect(slurm, *srun_args: str) -> list[dict]:  # noqa: F811
    code = ("import dataclasses, json, os, socket; from launcher.launch.env import detect; "
            "print(json.dumps({**dataclasses.asdict(detect()), 'job': os.environ['SLURM_JOB_ID'], "
            "'host': socket.gethostname(), 'nodelist': os.environ['SLURM_JOB_NODELIST']}))")
    done = slurm.run("srun", *srun_args, "--cpus-per-task=1", sys.executable, "-c", code, cwd=str(ROOT), timeout=120)
    return sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda t: t["rank"])


def test_srun_tasks_detect_their_ranks(slurm):  # noqa: F811
    tasks = _srun_detect(slurm, "--nodes=1", "--ntasks=2")
    assert [t["rank"] for t in tasks] == [0, 1] and [t["local_rank"] for t in tasks] == [0, 1]
    host = tasks[0]["host"]
    assert host in slurm.nodes
    for t in tasks:
        assert (t["world_size"], t["local_world_size"], t["source"], t["host"]) == (2, 2, "slurm", host)
        assert (t["master_addr"], t["master_port"]) == (host, slurm_port(int(t["job"])))


def test_two_nodes_srun_tasks_detect_their_ranks(slurm):  # noqa: F811
    """One task on each node: each runs on its own host (own host name, own address), rank = node, local rank 0,
    and both name the first node as the rendezvous host."""
    tasks = _srun_detect(slurm, "--nodes=2", "--ntasks-per-node=1")
    assert [t["host"] for t in tasks] == list(slurm.nodes)
    assert [(t["rank"], t["local_rank"], t["world_size"], t["local_world_size"]) for t in tasks] == \
        [(0, 0, 2, 1), (1, 0, 2, 1)]
    assert {t["master_addr"] for t in tasks} == {slurm.nodes[0]}
    assert expand_nodelist(tasks[0]["nodelist"]) == list(slurm.nodes)
    # each node reaches the other by name at its own address (what gloo and c10d need)
    seen = slurm.on_node(slurm.nodes[1], "getent", "hosts", slurm.nodes[0]).stdout.split()
    assert seen[:2] == [slurm.addr[slurm.nodes[0]], slurm.nodes[0]]


def test_nodelist_expansion_matches_scontrol(slurm):  # noqa: F811
    for nodelist in ("gpu[01-03,7],login[1-2]", "r[1-2]n[08-10]", "n[1-3],m[01-02]x[5-6]", "node[098-101],x",
                     ",".join(slurm.nodes)):
        done = slurm.run("scontrol", "show", "hostnames", nodelist)
        assert expand_nodelist(nodelist) == done.stdout.split(), nodelist


def test_sbatch_refusal_reaches_the_user_verbatim(slurm, tmp_path):  # noqa: F811
    done = subprocess.run([sys.executable, "-m", "launcher", "slurm", str(ROOT / "configs" / "demo.yaml"),
                           "--partition", "nosuch"], cwd=tmp_path, env=slurm.env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    first, *rest = done.stderr.splitlines()
    assert first.startswith("sbatch: error: ") and "partition" in first.lower(), done.stderr
    assert rest[-1].startswith("error: sbatch failed (exit 1) for ") and "check --partition" in rest[-1]
