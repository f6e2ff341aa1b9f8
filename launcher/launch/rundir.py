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
"""
from __future__ import annotations

import fcntl
import os
import socket
import time

from launcher.errors import ConfigError

LOCK = ".accum-sched.lock"
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
    if nnodes <= 1:
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


def release(fd: int) -> None:
    for path in [p for p, held_fd in _HELD.items() if held_fd == fd]:
        del _HELD[path]
    os.close(fd)


def release_all() -> None:
    for fd in list(_HELD.values()):
        release(fd)


def held() -> tuple[int, ...]:
    return tuple(_HELD.values())
