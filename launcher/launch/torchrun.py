"""argv for torch.distributed.run (torchrun). We never run a rendezvous of our own: standalone c10d on loopback for
one node, c10d at --rdzv-endpoint across nodes."""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

WORKER_MODULE = "launcher.worker"


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0


def run_id(output_dir: str) -> str:
    """A rendezvous id every node derives alike from the run directory, so agents of one run find each other."""
    return "accum-" + hashlib.sha1(output_dir.encode()).hexdigest()[:12]


def torchrun_argv(plan: LaunchPlan, worker_args: list[str], python: str = sys.executable) -> list[str]:
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.nproc_per_node)]
    if plan.nnodes == 1 and plan.rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += ["--nnodes", str(plan.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", plan.rdzv_endpoint,
                 "--rdzv-id", plan.rdzv_id or "accum-sched"]
        if plan.node_rank is not None:
            argv += ["--node-rank", str(plan.node_rank)]
    argv += ["--max-restarts", str(plan.max_restarts), "-m", WORKER_MODULE, *worker_args]
    return argv
