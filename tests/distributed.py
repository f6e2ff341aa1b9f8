"""Run a function on N real processes over gloo (torch.multiprocessing, spawn): several checks per launch."""
from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn, args):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    fn(rank, world, *args)
    import gc

    gc.collect()  # free DDP (it holds the group) before the group goes, not during interpreter finalization
    dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` fresh processes in one process group; re-raise any failure."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                           join=True, start_method="spawn")
