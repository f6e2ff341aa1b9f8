"""The process group checkpoints coordinate on: gloo, with a timeout of its own (``checkpoint.timeout_s``).

Saving and resuming leave the other ranks waiting while rank 0 works alone: it hashes and fsyncs every file of a
checkpoint (commit), or reads and hashes one back (verify at resume). On a large model that takes minutes. Waiting
on the default group is wrong twice over on GPUs: its timeout is the training timeout (``distributed.timeout_s``,
600 s by default), and under NCCL a timed-out collective is not an exception but the watchdog aborting the process,
so the careful "every rank raises the same error" path of launcher/checkpoint/checkpointer.py never runs. A gloo group works on
host memory (the small Python objects these collectives carry live there anyway), raises on timeout, and its
timeout can be as long as a save may take without loosening the training timeout.

``start()`` is called once per worker right after the default group (every rank must create a group, in the same
order); ``group()`` is what the Checkpointer uses: None in a single process.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_GROUP = None


def start(timeout_s: float):
    """Create the coordination group (collective: every rank calls it once). Returns it, or None without peers."""
    global _GROUP
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    else:
        _GROUP = None
    return _GROUP


def group():
    """The coordination group of this worker (None before start() or in a single process)."""
    return _GROUP
