"""`accum-sched run` under a scheduler that stops it with SIGTERM (Kubernetes, a local queue): hand the signal to
the workers, which checkpoint within about a micro-batch and exit 0, instead of dying with 143 and leaving them
without a checkpoint.

The workers, not torchrun, get the signal: torchrun answers SIGTERM by tearing its workers down after a grace
period and exits with an error whatever they did; left alone it sees them finish cleanly. The workers are found as
torchrun's children running the worker module (/proc); where there is no /proc, torchrun gets the signal. A second
SIGTERM is forwarded too (the workers then end at once). Standard library only.

A SIGKILL of `accum-sched run` itself cannot be forwarded: torchrun is started with the kernel's parent-death
signal (prctl PR_SET_PDEATHSIG) set to SIGTERM, so it winds its workers down as it would for any SIGTERM, and each
worker started by torchrun asks for SIGKILL when torchrun dies (launcher/worker.py): no worker outlives the
command (docs/reliability.md).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from launcher.launch import rundir
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


_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None, prctl=None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux; False elsewhere). ``parent``: the
    pid it must still have, else the parent ended before the request took effect and ``sig`` comes at once."""
    prctl = prctl or _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def call(argv: list[str], env: dict) -> tuple[int, list[int]]:
    """Run ``argv`` (torchrun) to its end, forwarding SIGTERM to its workers; torchrun gets SIGTERM if this process
    dies (SIGKILL included) and inherits the run directory's lock (launcher/launch/rundir.py). Returns (status,
    signals received)."""
    prctl, me = _prctl(), os.getpid()  # looked up before the fork: the child only makes the call
    proc = subprocess.Popen(argv, env=env, pass_fds=rundir.held(),
                            preexec_fn=(lambda: die_with_parent(signal.SIGTERM, me, prctl)) if prctl else None)
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
