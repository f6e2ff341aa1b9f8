"""The output directory of `accum-sched run`: checked before anything is written, and held by one run at a time
(docs/reliability.md). Standard library only.

- :func:`check_dirs`: run.output_dir and checkpoint.dir must be directories, or creatable under one (a path through
  a file, or on a read-only file system, is a one-line error with exit 2 before anything is written).
- :func:`hold`: an exclusive ``flock`` on ``<output_dir>/.accum-sched.lock`` for the run's lifetime: a second
  `accum-sched run` on the same directory (which would move the first run's checkpoints aside, then interleave
  metrics and checkpoints) stops with exit 2 naming the holder's pid and host. The kernel drops the lock when its
  holders end, however they end (SIGKILL included): there is no stale lock to clean up. torchrun inherits the
  descriptor (:func:`held`, launcher/launch/forward.py), so the directory stays held while it winds its workers
  down. Nodes of one multi-node run share the directory: each holds a lock of its own (named by node rank or host).
- :func:`hold_elastic`: the agents of one elastic run (``--nnodes MIN:MAX``, docs/elastic.md), on one machine or
  several sharing the directory, hold ``.accum-sched.lock`` together (a shared ``flock``) under the job's name,
  its rendezvous endpoint and id, written to ``.accum-sched-elastic``: an agent of the same job joins, a plain run
  (which wants the lock alone) or another elastic job is refused with exit 2. The first agent in learns that it
  is first (it alone may start the run afresh). ``flock`` over a network file system holds across hosts only
  where that file system supports it (NFSv4, Lustre with ``flock``): docs/elastic.md.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time

from launcher.errors import ConfigError

LOCK = ".accum-sched.lock"
ELASTIC_JOB = ".accum-sched-elastic"  # the name of the elastic job holding LOCK together
_ENTRY = ".accum-sched-elastic.lock"  # held a moment by an elastic agent deciding whether it is the first one in
_HELD: dict[str, int] = {}  # lock file -> descriptor, of the locks this process holds (torchrun inherits them)


def check_dirs(cfg) -> None:
    """Raise ConfigError when run.output_dir or checkpoint.dir cannot be a directory: a file in the way (the path
    itself or a parent), or a read-only place to create it in."""
    for field, path in (("run.output_dir", cfg.run.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not path:
            continue
        probe = os.path.abspath(path)
        while not os.path.lexists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            what = "is a file" if probe == os.path.abspath(path) else f"goes through the file {probe}"
            raise ConfigError(field, f"{path!r} {what}, not a directory",
                              f"give a directory (or move the file away): --set {field}=PATH")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(field, f"{probe} is not writable (permissions or a read-only file system)",
                              f"give a writable place: --set {field}=PATH")


def lock_name(nnodes: int = 1, node_rank: int | None = None) -> str:
    if nnodes <= 1:  # an elastic run's agents share LOCK instead (hold_elastic)
        return LOCK
    return f".accum-sched-node{node_rank if node_rank is not None else socket.gethostname()}.lock"


def hold(run_dir: str, nnodes: int = 1, node_rank: int | None = None) -> int:
    """Take the run directory's lock (creating the directory) and return its descriptor; keep it open for the run.
    Raises ConfigError naming the holder when another run holds it. This process holding it already (a test
    calling the command twice) gets the same descriptor."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(run_dir, lock_name(nnodes, node_rank)))
    if path in _HELD:
        return _HELD[path]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "pid unknown"
        finally:
            os.close(fd)
        raise ConfigError("run.output_dir", f"{run_dir} is in use by another `accum-sched run` ({holder})",
                          "wait for that run to end (or stop it), or give this one another run.output_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              .encode(), 0)
    _HELD[path] = fd
    return fd


def hold_elastic(run_dir: str, job: str, on_first=None) -> tuple[int, bool]:
    """Hold the run directory's lock together with the other agents of the elastic job ``job`` (its rendezvous
    endpoint and id). Returns ``(descriptor, first)``: ``first`` when no agent held it before (this one starts
    the run; the others join it); ``on_first()`` runs then, before any other agent may join (an earlier run's
    checkpoints moved aside before a joining agent's workers could pick one). Raises ConfigError naming the
    holder when a plain run, or another job, holds it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(run_dir, LOCK))
    if path in _HELD:
        return _HELD[path], False
    entry = os.open(os.path.join(run_dir, _ENTRY), os.O_RDWR | os.O_CREAT, 0o644)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(entry, fcntl.LOCK_EX)  # one agent at a time decides; held for milliseconds
        first = _try(fd, fcntl.LOCK_EX)
        if first:
            _write(os.path.join(run_dir, ELASTIC_JOB), job)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"elastic job {job}, first agent pid {os.getpid()} on {socket.gethostname()} since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
            if on_first is not None:
                on_first()
            fcntl.flock(fd, fcntl.LOCK_SH)  # not atomic, but every elastic agent waits on ``entry`` meanwhile
        elif not _try(fd, fcntl.LOCK_SH):
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "pid unknown"
            raise ConfigError("run.output_dir", f"{run_dir} is in use by another `accum-sched run` ({holder})",
                              "wait for that run to end (or stop it), or give this one another run.output_dir")
        else:
            other = _read(os.path.join(run_dir, ELASTIC_JOB))
            if other != job:
                raise ConfigError("run.output_dir", f"{run_dir} is in use by another elastic job ({other})",
                                  "give this agent the same --rdzv-endpoint as that job's agents to join it, or "
                                  "another run.output_dir")
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(entry)  # drops the entry lock
    _HELD[path] = fd
    return fd, first


def _try(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "unnamed"
    except OSError:
        return "unnamed"


def release(fd: int) -> None:
    for path in [p for p, held_fd in _HELD.items() if held_fd == fd]:
        del _HELD[path]
    os.close(fd)


def release_all() -> None:
    for fd in list(_HELD.values()):
        release(fd)


def held() -> tuple[int, ...]:
    return tuple(_HELD.values())
