"""A task's ``IterableDataset`` in the launcher: sharded over ranks and loader workers, read by a loader whose
position a checkpoint saves per rank, so that a resume continues mid-epoch without replaying trained data.

**Sharding** (``data.shard``). ``auto``: the stream is split into ``world x workers`` shards, shard ``rank x
workers + worker`` for each loader worker (``num_workers: 0`` counts as one worker). A dataset with a
``shard(num_shards, index)`` method (``builtin:stream_lm``'s TokenStream, a torchdata node, a Hugging Face
``IterableDataset``-like object) is asked for its shard, which it can read without the others; any other iterable
is read whole by every shard, each keeping every n-th item (correct, but every rank reads everything). ``none``: the
task shards it itself (by rank, and by worker with ``torch.utils.data.get_worker_info()``); the launcher reads it
as it is.

**Position**. :class:`ShardedStream` is the stateful dataset the loader sees: its ``state_dict()`` is the wrapped
dataset's own (where it has ``state_dict``/``load_state_dict``: an O(1) seek on resume) plus the number of items
read; a dataset without one is fast-forwarded on resume by reading and dropping that many items (no training on
them, but a read of them). The loader is torchdata's ``StatefulDataLoader`` (the ``streams`` extra), which keeps
every worker's state with each batch; without torchdata a plain loader in the main process does the same for
``num_workers: 0``.

**Which state is saved**. The engine reads micro-batches ahead of what it trains (accum_sched/streams.py), so
the loader's state now is ahead of the trained position. :class:`StreamLoader` records the loader's state after
every batch it hands out and gives the checkpoint the state after exactly the micro-batches the engine has
consumed (``state_at(engine.micro_in_epoch)``).
"""
from __future__ import annotations

import itertools
import warnings
from collections import deque

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from accum_sched.streams import READ_AHEAD
from launcher.errors import ConfigError

STATE_VERSION = 1
KEPT = 2 * READ_AHEAD + 4  # loader states kept: the engine holds at most READ_AHEAD + 1 micro-batches read ahead


def is_stream(dataset) -> bool:
    """A task's dataset is read as a stream when it is an ``IterableDataset``."""
    return isinstance(dataset, IterableDataset)


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class ShardedStream(IterableDataset):
    """``dataset`` as the loader of rank ``rank`` of ``world`` reads it (``split``: by rank and worker, as
    ``data.shard: auto``; else as it is), with a state: ``{"version", "shard": [n, i], "read": items, "source":
    the dataset's own state or None}``."""

    def __init__(self, dataset, rank: int = 0, world: int = 1, split: bool = True):
        super().__init__()
        self.dataset, self.rank, self.world, self.split = dataset, rank, world, split
        self._source = None  # (source, n, i, by_modulo): the shard this process reads, made on first use
        self._pending: dict | None = None  # a loaded state for the next iter()
        self._read = 0  # items of the source consumed by the live iterator (all of them, under by_modulo)
        self._fast_forwarded = False

    def set_epoch(self, epoch: int) -> None:
        """Passed on to a dataset that reshuffles per epoch."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def _shard(self):
        if self._source is None:
            info = get_worker_info()
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            n, i = (self.world * workers, self.rank * workers + worker) if self.split else (1, 0)
            if n > 1 and callable(getattr(self.dataset, "shard", None)):
                self._source = (self.dataset.shard(n, i), n, i, False)
            else:
                self._source = (self.dataset, n, i, n > 1)
        return self._source

    def state_dict(self) -> dict:
        if self._pending is not None:
            return dict(self._pending)
        source, n, i, _ = self._shard()
        return {"version": STATE_VERSION, "shard": [n, i], "read": self._read,
                "source": source.state_dict() if _stateful(source) else None}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a ShardedStream state (version {STATE_VERSION}): {state!r:.80}")
        _, n, i, _ = self._shard()
        if list(state["shard"]) != [n, i]:
            raise ValueError(f"the stream state is of shard {list(state['shard'])}, this loader reads shard "
                             f"{[n, i]} (world size or data.num_workers changed?)")
        self._pending = dict(state)

    def __iter__(self):
        source, n, i, by_modulo = self._shard()
        pending, self._pending = self._pending, None
        read = 0
        if pending is not None:
            read = int(pending["read"])
            if _stateful(source) and pending["source"] is not None:
                source.load_state_dict(pending["source"])
                iterator = iter(source)
            else:  # no state of its own: read past what was consumed (not trained again, only read)
                if not self._fast_forwarded and i == 0:
                    warnings.warn(f"{type(self.dataset).__name__} has no state_dict/load_state_dict: resuming "
                                  f"reads and drops the {read} items consumed before the checkpoint", stacklevel=2)
                self._fast_forwarded = True
                iterator = iter(source)
                for _ in itertools.islice(iterator, read):
                    pass
        else:
            iterator = iter(source)
        self._read = read
        for item in iterator:
            self._read += 1
            if not by_modulo or (self._read - 1) % n == i:
                yield item


class _PlainLoader:
    """The main-process loader used without torchdata: micro-batches collated from ``dataset`` (a ShardedStream),
    its state that of the dataset after the last batch handed out."""

    def __init__(self, dataset, batch_size: int, drop_last: bool, collate_fn):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.collate_fn = collate_fn or default_collate

    def __iter__(self):
        items = iter(self.dataset)
        while True:
            batch = list(itertools.islice(items, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield self.collate_fn(batch)

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["dataset"])


def make_loader(dataset, *, batch_size: int, drop_last: bool, num_workers: int, collate_fn, pin_memory: bool):
    """torchdata's StatefulDataLoader over ``dataset`` (a ShardedStream), else the plain main-process one."""
    try:
        # optional (torchdata): without it a stream has the plain main-process loader
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        if num_workers > 0:
            raise ConfigError("data.num_workers", f"is {num_workers}, but a stream read by loader workers needs "
                              "torchdata's StatefulDataLoader to resume exactly, and torchdata is not installed",
                              "pip install 'accum-sched[streams]', or set data.num_workers: 0") from None
        return _PlainLoader(dataset, batch_size, drop_last, collate_fn)
    extra = {"snapshot_every_n_steps": 1} if num_workers > 0 else {}  # every batch carries its workers' states
    with warnings.catch_warnings():
        # torchdata's constructor calls torch.set_vital, a deprecated no-op in torch 2.13: that one warning, from
        # torchdata only, says nothing a user can act on (every other warning still shows)
        warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning,
                                module=r"torchdata\.")
        return StatefulDataLoader(dataset, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
                                  collate_fn=collate_fn, pin_memory=pin_memory, **extra)


class StreamEpoch:
    """The stream's epoch for the sampler part of a checkpoint (parts.SamplerEpoch reads ``epoch``, calls
    ``set_epoch``): the dataset hears of every epoch, as a DistributedSampler would."""

    def __init__(self, dataset: ShardedStream):
        self.dataset, self.epoch = dataset, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.dataset.set_epoch(self.epoch)


class StreamLoader:
    """One rank's stream loader, as the Trainer and the Checkpointer use it (the checkpoint part ``stream``).

    :meth:`epoch` is what the engine iterates for one epoch (no ``len()``: the engine's stream path). A resumed
    epoch starts where the loaded state says (the engine is told skip=False). :meth:`state_at` is the state after
    ``micro`` micro-batches of the current epoch, for a checkpoint taken there."""

    def __init__(self, dataset: ShardedStream, loader):
        self.dataset, self.loader = dataset, loader
        self._states: deque = deque(maxlen=KEPT)  # (micro-batches of the epoch handed out, the loader's state after)
        self._loaded: tuple[int, dict] | None = None  # (micro-batch, state) of a resume, until the epoch begins

    def epoch(self, start: int, rng, replay: dict | None):
        """The epoch's iterable: the loader from micro-batch ``start`` (the loaded position, if any); ``rng``
        (checkpoint.rng.RankRng) sees the iter() as for a map-style loader."""
        return _Epoch(self, start, rng, replay)

    def state_at(self, micro: int) -> dict | None:
        """The loader's state after ``micro`` micro-batches of this epoch (None at 0: the epoch starts afresh)."""
        if micro == 0:
            return None
        for done, state in reversed(self._states):
            if done == micro:
                return state
        if self._loaded is not None and self._loaded[0] == micro:
            return self._loaded[1]  # saved again before a micro-batch of the resumed epoch was read
        raise RuntimeError(f"no stream state recorded after micro-batch {micro} (recorded: "
                           f"{[d for d, _ in self._states]}); the engine read further ahead than {KEPT}")

    def load_state_dict(self, state: dict, micro: int) -> None:
        """Position the loader after ``micro`` micro-batches of the epoch it resumes."""
        self.loader.load_state_dict(state)
        self._loaded = (micro, state)

    def _iterate(self, iterator, start: int):
        self._states.clear()
        done = start
        for batch in iterator:
            done += 1
            self._states.append((done, self.loader.state_dict()))
            yield batch


class _Epoch:
    def __init__(self, owner: StreamLoader, start: int, rng, replay):
        self.owner, self.start, self.rng, self.replay = owner, start, rng, replay

    def __iter__(self):
        self.rng.before_iter()
        if self.start == 0:
            self.owner._loaded = None  # a new pass: a loaded state belongs to an epoch that has begun
        iterator = self.owner._iterate(iter(self.owner.loader), self.start)  # iter() now: its seed draw is here
        if self.replay is not None:
            self.rng.restore(self.replay)
        return iterator


def build(task, cfg, rank: int, world: int, pin_memory: bool) -> tuple[StreamEpoch, StreamLoader]:
    """The sampler part and the loader of this rank for ``task.dataset`` (a stream)."""
    data = cfg.data
    dataset = ShardedStream(task.dataset, rank, world, split=data.shard == "auto")
    loader = make_loader(dataset, batch_size=data.micro_batch_size, drop_last=data.drop_last,
                         num_workers=data.num_workers, collate_fn=task.collate_fn, pin_memory=pin_memory)
    return StreamEpoch(dataset), StreamLoader(dataset, loader)
