"""``checkpoint.async``: a checkpoint written beside training, at most one at a time.

The step that saves pays only for a copy of the state in host memory (:func:`host_copy`; FSDP2's shards are staged
by DCP's ``async_save``); serialising, writing, fsync, the ranks' agreement and the commit (manifest last, then the
rename, exactly as a synchronous save: launcher/checkpoint/store.py) run in one background thread
(``concurrent.futures``). Its collectives go over a gloo group of its own (coordination.background_group), never
the group the training thread uses, so the two threads never share one group's order of collectives.

The next save, a stop, the end of the run and a failure wait for the save in flight (:meth:`InFlight.wait`); the
first time a save finds the previous one still writing, rank 0 says so once on stderr.
"""
from __future__ import annotations

import copy
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def host_copy(value):
    """``value`` with every tensor copied into new host memory (dicts, lists and tuples walked; their types kept),
    so that training may change parameters, optimizer state and gradients while the copy is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = copy.copy(value)  # an OrderedDict stays one
        for key, item in value.items():
            out[key] = host_copy(item)
        return out
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, tuple):
        items = [host_copy(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return copy.deepcopy(value)


class InFlight:
    """One background thread and the save it runs (None when idle). ``say`` prints on rank 0's stderr."""

    def __init__(self, say):
        self._say = say
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._path: str | None = None
        self._said = False

    def submit(self, path: str, job) -> None:
        """Run ``job()`` (write and commit ``path``) in the background; the previous save must be waited for."""
        assert self._future is None, "one checkpoint in flight at a time: wait() first"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accum-sched-checkpoint")
        self._future, self._path = self._pool.submit(job), path

    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self, next_save: bool = False) -> None:
        """Block until the save in flight is committed (or failed: its error is raised here, on every rank, since
        the ranks agreed on it in the background). ``next_save``: a new checkpoint is due; said once when it has
        to wait."""
        if self._future is None:
            return
        if next_save and not self._said and not self._future.done():
            self._said = True
            self._say(f"checkpoint.async: a checkpoint is due while {self._path} is still being written; training "
                      "waits for it (at most one in flight; said once: checkpoints come faster than they are "
                      "written)", sys.stderr)
        future, self._future = self._future, None
        future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
