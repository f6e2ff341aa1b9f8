"""The process group checkpoints coordinate on: gloo, with a timeout of its own (``checkpoint.timeout_s``).

Saving and resuming leave the other ranks waiting while rank 0 works alone: it hashes and fsyncs every file of a
checkpoint (commit), or reads and hashes one back (verify at resume). On a large model that takes minutes. Waiting
on the default group is wrong twice over on GPUs: its timeout is the training timeout (``distributed.timeout_s``,
600 s by default), and under NCCL a timed-out collective is not an exception but the watchdog aborting the process,
so the careful "every rank raises the same error" path of launcher/checkpoint/checkpointer.py never runs. A gloo
group works on host memory (the small Python objects these collectives carry live there anyway), raises on timeout,
and its timeout can be as long as a save may take without loosening the training timeout.

``start()`` is called once per worker right after the default group (every rank must create a group, in the same
order); ``group()`` is what the Checkpointer uses: None in a single process. ``collective()`` runs one of its
collectives so that a wait past the timeout, or a peer that gave up, ends in an error naming
``checkpoint.timeout_s`` on the rank that sees it, instead of gloo's bare "Timed out waiting 10000ms".
"""
from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

_GROUP = None
_BACKGROUND = None  # checkpoint.async: the group of the thread that writes and commits beside training
_TIMEOUT_S: float | None = None


class CoordinationError(RuntimeError):
    """A checkpoint collective did not complete: this rank waited past checkpoint.timeout_s, or a peer is gone."""


def start(timeout_s: float, background: bool = False):
    """Create the coordination group (collective: every rank calls it once). Returns it, or None without peers.

    ``background`` (checkpoint.async): also a second gloo group for the thread that writes and commits a checkpoint
    beside training (launcher/checkpoint/background.py). A process group's collectives must come in the same order
    on every rank, which two threads sharing one group could not promise."""
    global _GROUP, _BACKGROUND, _TIMEOUT_S
    _TIMEOUT_S = timeout_s
    _GROUP = _BACKGROUND = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if background:
            _BACKGROUND = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _GROUP


def background_group():
    """The group of the background checkpoint thread (None in a single process, or without checkpoint.async)."""
    return _BACKGROUND


def group():
    """The coordination group of this worker (None before start() or in a single process)."""
    return _GROUP


def collective(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a torch.distributed collective on the coordination group); a failure of it raises
    CoordinationError that says what was waited for and names checkpoint.timeout_s. gloo raises RuntimeError
    (DistBackendError) both on its own timeout and when a peer's connection closes (that peer gave up or died)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        limit = f"checkpoint.timeout_s ({_TIMEOUT_S:g} s)" if _TIMEOUT_S is not None else "checkpoint.timeout_s"
        # gloo's own words, less its source location ("[.../pair.cc:553] Connection closed by peer ...")
        detail = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        if "timed out" in str(exc).lower():
            problem = (f"rank {rank} waited longer than {limit} for the other ranks "
                       f"(rank 0 writes, hashes and verifies checkpoints alone); "
                       f"raise checkpoint.timeout_s if a checkpoint takes that long here")
        else:
            problem = (f"rank {rank} lost the other ranks while waiting: one failed, or waited longer than "
                       f"{limit} and gave up")
        raise CoordinationError(f"checkpoint {what}: {problem} (gloo: {detail})") from exc
