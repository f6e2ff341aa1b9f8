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
command (docs/reliability.md). The worker asks before it imports torch (seconds), and checks that its parent is
still the torchrun this command started: the command hands its own pid down (``LAUNCHER_PID_ENV``) and the worker
compares its parent's parent with it. Reading the parent pid back at the moment of the request would pass when
torchrun had already died (the parent is then init, or a subreaper), leaving an orphan retrying its TCPStore.

SIGINT (Ctrl-C, sent to the whole foreground process group) is a stop like SIGTERM: torchrun ignores it (it is
started with SIGINT ignored and told to handle only SIGTERM, SIGHUP and SIGQUIT: otherwise it would hand it to
the workers as a KeyboardInterrupt and exit 1), this command forwards it to the workers, which commit the open
window and exit 0, and the command exits 130 with the resume hint (launcher/cli/run.py).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from launcher.launch import rundir
from launcher.launch.torchrun import WORKER_MODULE

FORWARDED = (signal.SIGTERM, signal.SIGINT)
PREEMPTED_STATUS = 75  # EX_TEMPFAIL: stopped early with a checkpoint; `accum-sched run ... --resume` continues
INTERRUPTED_STATUS = 130  # 128 + SIGINT, the shell's status for Ctrl-C; the checkpoint is committed all the same
LAUNCHER_PID_ENV = "ACCUM_SCHED_LAUNCHER_PID"  # the pid of `accum-sched run`, torchrun's parent


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


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (/proc), None where unknown (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # the command name may hold spaces and ')'
    except (OSError, ValueError, IndexError):
        return None


def guard_worker(environ=os.environ, prctl=None) -> bool:
    """A worker started by torchrun under `accum-sched run`: SIGKILL when torchrun dies, and at once when torchrun
    is gone already, i.e. when this process's parent is no longer a child of the pid `accum-sched run` handed down
    (``LAUNCHER_PID_ENV``). Without that variable (torchrun started by an sbatch script) the parent read now is
    the one checked, as before. False where the request cannot be made (not Linux)."""
    launcher = environ.get(LAUNCHER_PID_ENV, "")
    parent = os.getppid()
    if not die_with_parent(signal.SIGKILL, parent, prctl):
        return False
    if launcher.isdigit() and parent_of(parent) != int(launcher):  # torchrun died before the request
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def disposition(pid: int, signum: int) -> str | None:
    """``"ignored"``, ``"caught"`` or ``"default"``: what process ``pid`` does with ``signum`` now (its SigIgn and
    SigCgt masks in /proc); None when it cannot be read (gone, or no /proc)."""
    masks = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("SigIgn:", "SigCgt:")):
                    masks[line[:6]] = int(line.split()[1], 16) >> (signum - 1) & 1
    except (OSError, ValueError):
        return None
    if len(masks) < 2:
        return None
    return "ignored" if masks["SigIgn"] else "caught" if masks["SigCgt"] else "default"


def pass_on_late(late: set[int], pids: list[int], signum: int) -> list[int]:
    """A Ctrl-C that came while workers still imported torch (ignoring SIGINT, as torchrun started them: see the
    module's doc) would be lost. Remember each of ``pids`` that ignores ``signum`` in ``late``, and send it once to
    each remembered one that now catches it (its stop handler is in place); returns those sent to. Never twice: a
    second SIGINT ends a worker at once."""
    sent = []
    for pid in pids:
        state = disposition(pid, signum)
        if state == "ignored":
            late.add(pid)
        elif state == "caught" and pid in late:
            late.discard(pid)
            try:
                os.kill(pid, signum)
                sent.append(pid)
            except ProcessLookupError:
                pass
    return sent


def call(argv: list[str], env: dict) -> tuple[int, list[int]]:
    """Run ``argv`` (torchrun) to its end, forwarding SIGTERM and SIGINT to its workers; torchrun gets SIGTERM if
    this process dies (SIGKILL included) and inherits the run directory's lock (launcher/launch/rundir.py). Returns
    (status, signals received)."""
    prctl, me = _prctl(), os.getpid()  # looked up before the fork: the child only makes the call
    env = {**env, LAUNCHER_PID_ENV: str(me)}

    def in_torchrun():  # between fork and exec: SIGINT stays ignored in torchrun and its workers until they say
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if prctl:
            die_with_parent(signal.SIGTERM, me, prctl)

    proc = subprocess.Popen(argv, env=env, pass_fds=rundir.held(), preexec_fn=in_torchrun)
    received: list[int] = []

    late: set[int] = set()  # workers that ignored the Ctrl-C: it is passed on once they catch SIGINT

    def forward(signum, frame):
        received.append(signum)
        pids = worker_pids(proc.pid)
        if signum == signal.SIGINT:
            pass_on_late(late, pids, signum)
        for pid in pids or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:  # a wait the signal handler cannot extend: after a Ctrl-C, look twice a second for workers that
                status = proc.wait(timeout=0.5)  # have not installed their handler yet
                break
            except subprocess.TimeoutExpired:
                if signal.SIGINT in received:
                    pass_on_late(late, worker_pids(proc.pid), signal.SIGINT)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status, received
