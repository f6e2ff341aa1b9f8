"""How the ranks agree around a checkpoint: rank 0 decides and every rank gets the answer or the same error; a
phase fails on every rank when it fails on one (no rank left waiting in a barrier until the timeout).

Every collective runs on the gloo coordination group (launcher/checkpoint/coordination.py), not the default one.
"""
from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist

from launcher.checkpoint import coordination
from launcher.errors import CheckpointError, ConfigError


class RefusedCheckpoint(ConfigError, CheckpointError):
    """Rank 0 refused the checkpoint for a reason the user fixes (another config, a world size the policy refuses,
    a factor that does not come out whole): the same one line on every rank, which the worker prints and exits 2
    with (launcher/worker.py), instead of a traceback."""

    every_rank = True  # launcher/worker.py: said once per run (an elastic run: once per node)


class Ranks:
    """This rank among ``world``, coordinating on ``group``."""

    def __init__(self, rank: int, world: int, group):
        self.rank, self.world, self.group = rank, world, group

    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world > 1

    def on_rank0(self, fn):
        """Rank 0 decides (reads the disk), every rank gets the same answer or raises the same error."""
        result = error = None
        refused = False  # bad input (a ConfigError): every rank raises RefusedCheckpoint, one line and exit 2
        if self.rank == 0:
            try:
                result = fn()
            except ConfigError as exc:
                error, refused = (exc.field, exc.problem, exc.hint), True
            except Exception as exc:  # noqa: BLE001 -- the other ranks must not wait for an answer forever
                error = f"{type(exc).__name__}: {exc}"
        if self.distributed():
            box = [result, error, refused]
            coordination.collective("decision of rank 0", dist.broadcast_object_list, box, src=0, group=self.group)
            result, error, refused = box
        if refused:
            raise RefusedCheckpoint(*error)
        if error:
            raise CheckpointError(error)
        return result

    def together(self, what: str, fn) -> list:
        """Run ``fn`` on this rank, then raise on every rank if it failed on any (doubles as a barrier). Returns
        every rank's result (small: they travel in the same gather as the errors)."""
        result = error = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 -- reported on every rank below
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        gathered = [(error, result)]
        if self.distributed():
            gathered = [None] * self.world
            coordination.collective(what, dist.all_gather_object, gathered, (error, result), group=self.group)
        failed = [e for e, _ in gathered if e]
        if failed:
            raise CheckpointError(f"checkpoint {what} failed: {'; '.join(failed)}")
        return [r for _, r in gathered]

    def gather(self, value, what: str = "gathering states") -> list:
        """Every rank's ``value``, on every rank."""
        if not self.distributed():
            return [value]
        values = [None] * self.world
        coordination.collective(what, dist.all_gather_object, values, value, group=self.group)
        return values

    def barrier(self) -> None:
        if self.distributed():
            coordination.collective("barrier", dist.barrier, group=self.group)

    def say(self, text: str, stream=None) -> None:
        if self.rank == 0:
            print(f"accum-sched: {text}", file=stream or sys.stdout, flush=True)


def must_see(path: str, name: str | None = None) -> None:
    """Raise unless this rank sees ``path`` (a directory rank 0 chose or made), and ``name`` in it.

    Rank 0 alone picks the checkpoint to resume and makes the directory a save writes into; every rank then reads
    (resume) or writes (DeepSpeed's and FSDP2's shards) there, which needs one file system shared by every node."""
    target = path if name is None else os.path.join(path, name)
    if not (os.path.isdir(path) and (name is None or os.path.exists(target))):
        raise CheckpointError(f"{target} (chosen by rank 0) is not visible on host {socket.gethostname()}: "
                              f"checkpoint.dir must be on a file system shared by every node "
                              f"(set checkpoint.dir to such a path)")
