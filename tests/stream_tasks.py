"""Stream tasks for the launcher's stream tests (``stream_tasks:numbers``, ``stream_tasks:stream_lm``).

``numbers`` is an ``IterableDataset`` of regression samples, sample ``k`` drawn from a generator seeded with ``k``
(so a test can rebuild any sample), with a mask of 1..4 real elements (a tokens-keyed schedule then differs from a
samples-keyed one). ``length`` None: endless. ``stateful``: it has ``state_dict``/``load_state_dict`` (the position
``k``), else the launcher fast-forwards it on resume. ``shardable``: it has ``shard(n, i)`` (samples ``k % n == i``),
else the launcher keeps every n-th item.

Both tasks record, per rank, what the test cannot see from model.pt (rank 0's) through environment variables (not
task.args, which the config hash covers):

  RECORD_DIR   after every optimizer step, every rank writes ``params-rank<R>.pt`` (its model's parameters) and
               ``reads-rank<R>-pid<P>.txt`` (the sample indices ``numbers`` produced in this process, one per line)
  FAULT_*      as in faulty_tasks (kill or raise at a rank's N-th loss_fn call); FAULT_MODE=term sends SIGTERM to
               the worker itself there (a preemption that reached one rank)
"""
from __future__ import annotations

import os
import signal

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import IterableDataset

import faulty_tasks
from launcher.tasks import stream_lm as builtin_stream_lm

IN, OUT, WIDTH = 4, 2, 4  # features, targets, elements per sample (masked to 1..WIDTH)


def sample(k: int):
    """Sample ``k``: (x[WIDTH, IN], y[WIDTH, OUT], mask[WIDTH]) with 1..WIDTH real rows."""
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(WIDTH, IN, generator=g)
    y = torch.tanh(x.sum(-1, keepdim=True).repeat(1, OUT) * 0.5) + 0.1 * torch.randn(WIDTH, OUT, generator=g)
    real = 1 + int(torch.randint(WIDTH, (), generator=g))
    mask = torch.arange(WIDTH) < real
    return x, y, mask


class Numbers(IterableDataset):
    def __init__(self, length: int | None, num_shards: int = 1, index: int = 0, reads: list | None = None):
        super().__init__()
        self.length, self.num_shards, self.index = length, num_shards, index
        self.reads = reads if reads is not None else []
        self._next: int | None = None  # the position to start from (a loaded state)
        self._at = index  # of the live iterator: the next k it yields

    def __iter__(self):
        k = self._next if self._next is not None else self.index
        self._next = None
        while self.length is None or k < self.length:
            self.reads.append(k)
            self._at = k + self.num_shards
            yield sample(k)
            k += self.num_shards


class StatefulNumbers(Numbers):
    def state_dict(self) -> dict:
        return {"next": self._next if self._next is not None else self._at}

    def load_state_dict(self, state: dict) -> None:
        self._next = int(state["next"])


class ShardableNumbers(StatefulNumbers):
    def shard(self, n: int, i: int):
        return type(self)(self.length, self.num_shards * n, self.index + self.num_shards * i, self.reads)


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _record_after_every_step(model: nn.Module, reads: list | None) -> None:
    """After every optimizer step of this process (torch's global post-step hook, not the product's callbacks),
    write the model's parameters and the indices read so far: the files left are those after the last step. (The
    worker ends with os._exit, so an atexit handler would never run.)"""
    folder = os.environ.get("RECORD_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)

    def write(optimizer, args, kwargs):
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(folder, f"params-rank{_rank()}.pt"))
        if reads is not None:
            with open(os.path.join(folder, f"reads-rank{_rank()}-pid{os.getpid()}.txt"), "w") as f:
                f.write("".join(f"{k}\n" for k in reads))
    register_optimizer_step_post_hook(write)


def _faulty(loss_fn):
    calls = [0]

    def wrapped(model, batch):
        calls[0] += 1
        if os.environ.get("FAULT_MODE") == "term":
            if _rank() == os.environ.get("FAULT_RANK") and calls[0] == int(os.environ["FAULT_AT"]) \
                    and not os.path.exists(os.environ["FAULT_MARKER"]):
                open(os.environ["FAULT_MARKER"], "w").close()
                os.kill(os.getpid(), signal.SIGTERM)
        else:
            faulty_tasks._maybe_fail(calls[0])
        return loss_fn(model, batch)
    return wrapped


def numbers_loss(model, batch):
    x, y, mask = batch
    per_element = ((model(x) - y) ** 2).mean(-1)
    return (per_element * mask).sum(), mask.sum()


def numbers_count(batch) -> int:
    return int(batch[2].sum())


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))


def numbers(length: int | None = None, stateful: bool = True, shardable: bool = False, val_length: int | None = None):
    kind = ShardableNumbers if shardable else StatefulNumbers if stateful else Numbers
    reads: list[int] = []
    model = make_model()
    _record_after_every_step(model, reads)
    task = {"model": model, "dataset": kind(length, reads=reads), "loss_fn": _faulty(numbers_loss),
            "count_fn": numbers_count}
    if val_length is not None:
        task["val_dataset"] = kind(val_length)
    return task


def stream_lm(**args):
    """builtin:stream_lm with the per-rank record and the faults."""
    task = builtin_stream_lm.stream_lm(**args)
    _record_after_every_step(task["model"], None)
    task["loss_fn"] = _faulty(task["loss_fn"])
    return task
