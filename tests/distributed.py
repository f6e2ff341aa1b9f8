"""Run a function on N real processes over gloo (torch.multiprocessing, spawn): several checks per launch."""
from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    fn(rank, world, *args)
    leave()


def leave() -> None:
    """End a rank that has done everything: the ranks meet, so none leaves while a peer still talks to it, then exit
    at once. gloo's teardown during interpreter finalization occasionally aborts a process that has done everything
    ("terminate called without an active exception"; seen with plain DDP loops and Accelerate's own loop too). A
    failure raises before this and is reported."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, deadline_s: float | None = None) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` fresh processes in one process group; re-raise any failure.

    With ``deadline_s`` the ranks are killed and the test fails if they still run by then (a hung collective fails
    in bounded time instead of after gloo's 30-minute timeout).
    """
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                                     join=False, start_method="spawn")
        start = time.monotonic()
        while not context.join(timeout=1.0):
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"ranks still running after {deadline_s} s: a collective hangs")


def attempt(fn) -> dict:
    """Run ``fn`` on a rank; return what happened, for the test process to judge: its result, the exception type and
    message (or None), the warnings raised and the seconds taken."""
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = fn(), None
        except Exception as exc:  # judged by the test process
            result, error = None, [type(exc).__name__, str(exc)]
    return {"result": result, "error": error, "warnings": [str(w.message) for w in caught],
            "seconds": time.monotonic() - start}
