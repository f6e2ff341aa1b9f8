"""Against the real single-node SLURM controller (tests/slurm_cluster.py): launch detection under srun, the host list
syntax as scontrol reads it, and sbatch's own refusals reaching the user. No torch in these processes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.env import expand_nodelist, slurm_port
from slurm_cluster import slurm  # noqa: F401  (the session fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_srun_tasks_detect_their_ranks(slurm):  # noqa: F811
    code = ("import dataclasses, json, os; from launcher.env import detect; "
            "print(json.dumps({**dataclasses.asdict(detect()), 'job': os.environ['SLURM_JOB_ID']}))")
    done = slurm.run("srun", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", sys.executable, "-c", code,
                     cwd=str(ROOT), timeout=120)
    tasks = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda t: t["rank"])
    assert [t["rank"] for t in tasks] == [0, 1] and [t["local_rank"] for t in tasks] == [0, 1]
    for t in tasks:
        assert (t["world_size"], t["local_world_size"], t["source"]) == (2, 2, "slurm")
        assert (t["master_addr"], t["master_port"]) == (slurm.host, slurm_port(int(t["job"])))


def test_nodelist_expansion_matches_scontrol(slurm):  # noqa: F811
    for nodelist in ("gpu[01-03,7],login[1-2]", "r[1-2]n[08-10]", "n[1-3],m[01-02]x[5-6]", "node[098-101],x",
                     slurm.host):
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
