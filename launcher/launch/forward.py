"""`accum-sched run` under a scheduler that stops it with SIGTERM (Kubernetes, a local queue): hand the signal to
the workers, which checkpoint within about a micro-batch and exit 0, instead of dying with 143 and leaving them
without a checkpoint.

The workers, not torchrun, get the signal: torchrun answers SIGTERM by tearing its workers down after a grace
period and exits with an error whatever they did; left alone it sees them finish cleanly. The workers are found as
torchrun's children running the worker module (/proc); where there is no /proc, torchrun gets the signal. A second
SIGTERM is forwarded too (the workers then end at once). Standard library only.
"""
from __future__ import annotations

import os
import signal
import subprocess

from launcher.launch.torchrun import WORKER_MODULE

FORWARDED = (signal.SIGTERM,)
PREEMPTED_STATUS = 75  # EX_TEMPFAIL: stopped early with a checkpoint; `accum-sched run ... --resume` continues


def worker_pids(parent: int) -> list[int]:
    """Children of ``parent`` whose command line runs the worker module (empty without /proc)."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # the command name may hold spaces and ')'
            if ppid != parent:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if WORKER_MODULE.encode() in argv:
            pids.append(int(name))
    return pids


def call(argv: list[str], env: dict) -> tuple[int, list[int]]:
    """Run ``argv`` (torchrun) to its end, forwarding SIGTERM to its workers. Returns (status, signals received)."""
    proc = subprocess.Popen(argv, env=env)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for pid in worker_pids(proc.pid) or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        status = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status, received
