"""argv for torch.distributed.run (torchrun). We never run a rendezvous of our own: standalone c10d on loopback for
one node, c10d at --rdzv-endpoint across nodes. An elastic run (``nnodes`` "MIN:MAX", docs/elastic.md) gets torchrun's
elastic agent with ``--nnodes MIN:MAX`` and no node rank (the rendezvous numbers the nodes anew each round)."""
from __future__ import annotations

import errno
import hashlib
import os
import socket
import sys
from dataclasses import dataclass

from launcher.errors import ConfigError

WORKER_MODULE = "launcher.worker"


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int | str = 1  # "MIN:MAX": elastic
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf (rendezvous timeouts: docs/elastic.md)


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
        if plan.rdzv_conf:
            argv += ["--rdzv-conf", plan.rdzv_conf]
    # SIGINT is not torchrun's: `accum-sched run` forwards it to the workers as a stop (launcher/launch/forward.py)
    argv += ["--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT"]
    argv += ["--max-restarts", str(plan.max_restarts), "-m", WORKER_MODULE, *worker_args]
    return argv


def elastic_env(env: dict) -> dict:
    """The environment of an elastic run's torchrun. Each rendezvous round gets a fresh worker store on its rank-0
    node (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): with the store shared across rounds (torch 2.13's default), a round
    re-formed after a join restarts no counter, so its gloo keys would meet the last round's, and a node whose
    rank 0 died would keep the dead node's address. ACCUM_SCHED_ELASTIC tells the workers that every round after a
    change continues from the newest checkpoint (launcher/checkpoint/checkpointer.py)."""
    return {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", ELASTIC_ENV: "1"}


ELASTIC_ENV = "ACCUM_SCHED_ELASTIC"  # read by launcher/checkpoint/resume.py's ELASTIC_ENV (same name; no import)


def check_endpoint(endpoint: str, nnodes: int = 1, node_rank: int | None = None) -> None:
    """Raise ConfigError when the rendezvous port of --rdzv-endpoint is taken on this host, where this node's
    torchrun would serve it: torchrun would connect to whatever listens there as if it were the rendezvous and wait
    (silently, until its timeout). Checked on the node that serves it (node rank 0, or any node when the rank is
    left to the rendezvous); a host that is not this one, or does not resolve here, is left to torchrun, and so is
    a port held by another node's agent of the same run on this host (several nodes on one machine)."""
    if nnodes > 1 and node_rank not in (None, 0):
        return
    host, _, port_text = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError("--rdzv-endpoint", f"{endpoint!r}: port {port_text!r} is not a number",
                          "write e.g. node01:29400") from None
    if not 0 < port < 65536:
        raise ConfigError("--rdzv-endpoint", f"{endpoint!r}: port {port} is outside 1..65535",
                          "write e.g. node01:29400")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    holder = listener(port)
                    if nnodes > 1 and (holder is None or endpoint in holder[1]):
                        return  # another node's agent of this run on this host (or one we cannot tell from it)
                    who = f"pid {holder[0]}: {holder[1][:80]}" if holder else "another program"
                    raise ConfigError("--rdzv-endpoint", f"port {port} on {host} is in use by {who} (torchrun "
                                      "would wait on it as if it were the rendezvous)",
                                      f"pick a free port, e.g. {host}:{_free_port(family, address)}, or stop what "
                                      "holds it") from None
                # EADDRNOTAVAIL: not an address of this host, another node serves it


def _free_port(family, address) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address[0], 0))
        return probe.getsockname()[1]


def listener(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on TCP ``port`` here, from /proc (None where unknown)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return int(pid), " ".join(f.read().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            continue
    return None
