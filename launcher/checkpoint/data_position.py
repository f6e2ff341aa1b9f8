"""Where in the data a resumed run continues: the epoch's loader positioned at the resume point, and, after a world
size change, the rest of an interrupted epoch re-dealt over the new ranks in the same global order (so every sample
of that epoch is still trained exactly once).

Resume loads nothing already trained: the DataLoader's sampler starts at the resume point
(accum_sched.ResumeSampler, the engine told skip=False).
"""
from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler

from accum_sched.resume import ResumeSampler
from launcher.checkpoint.rng import RankRng
from launcher.errors import ConfigError


def global_order(dataset, epoch: int, world: int, shuffle: bool, seed: int) -> list[int]:
    """The epoch's samples as DistributedSampler deals them over ``world`` ranks, read rank-interleaved: position
    j of rank r is global position j*world + r, so the first k micro-batches of every rank are a prefix."""
    shards = []
    for r in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=shuffle, seed=seed, drop_last=False)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


def deal(order: list[int], world: int, rank: int) -> list[int]:
    """This rank's share of ``order``, padded like DistributedSampler so every rank gets as many samples."""
    if not order:
        return []
    padded = list(order)
    while len(padded) % world:
        padded += order[: world - len(padded) % world]
    return padded[rank::world]


def resume_position(engine_state: dict, saved_order: dict | None, old_world: int, world: int,
                    batches_per_epoch: int, micro_batch_size: int,
                    full_order) -> tuple[dict, tuple[int, list[int]] | None]:
    """The engine position to continue from, and the (epoch, global sample order) to re-deal over the ranks, or None.

    On another world size an epoch interrupted mid-way is re-dealt: its samples not trained yet, in the same global
    order, over the new ranks (the engine then starts that epoch at micro-batch 0 of the re-dealt loader). An epoch
    re-dealt before keeps its order (``saved_order``, from trainer.pt); otherwise ``full_order(epoch)`` is the
    epoch's order as the old world dealt it (:func:`global_order`)."""
    epoch, micro = int(engine_state["epoch_index"]), int(engine_state["micro_in_epoch"])
    saved = None if saved_order is None or int(saved_order["epoch"]) != epoch else saved_order["indices"].tolist()
    if old_world != world and micro > 0:
        if micro >= batches_per_epoch:  # the epoch was complete: continue with the next one
            engine_state["epoch_index"], engine_state["micro_in_epoch"] = epoch + 1, 0
            return engine_state, None
        full = saved if saved is not None else full_order(epoch)
        engine_state["micro_in_epoch"] = 0
        return engine_state, (epoch, full[old_world * micro * micro_batch_size:])
    if saved is not None:
        return engine_state, (epoch, saved)  # a re-dealt epoch, resumed on the same world
    return engine_state, None


def redealt_loader(loader, share: list[int]) -> DataLoader:
    """``loader``'s settings over this rank's share of a re-dealt epoch."""
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=ResumeSampler(share),
                      drop_last=loader.drop_last, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory)


class EpochLoader:
    """The loader the engine sees for one epoch, positioned at the resume point (the engine runs it with
    skip=False): len() counts the micro-batches left, iter() loads only those, with the RNG handled by ``rng``
    (rng.RankRng: the epoch-start state recorded, a resume's state put back). The epoch's length in
    micro-batches is, told to ``on_iter(batches)`` when iterated (the manifest records it)."""

    def __init__(self, loader, rng: RankRng, start: int = 0, state: dict | None = None, on_iter=None):
        self.loader, self.rng, self.start, self.state, self.on_iter = loader, rng, start, state, on_iter
        self.positioned = isinstance(getattr(loader, "sampler", None), ResumeSampler)
        if self.positioned:
            loader.sampler.start_at(start * loader.batch_size)

    def __len__(self) -> int:
        return len(self.loader) if self.positioned else max(0, len(self.loader) - self.start)

    def __iter__(self):
        self.rng.before_iter()
        if self.on_iter is not None:
            self.on_iter(self.start + len(self))
        iterator = iter(self.loader)
        if not self.positioned:  # a loader without ResumeSampler: position it the slow way, loading what it skips
            for _ in range(self.start):
                next(iterator)
        if self.state is not None:
            self.rng.restore(self.state)
        return iterator


# -- data.sampler: invariant (accum_sched.invariant) ---------------------------------------------------------------
def invariant_sampler(sampler_part):
    """The run's InvariantBatchSampler behind the checkpoint's sampler part, or None (DistributedSampler, a stream)."""
    sampler = getattr(sampler_part, "sampler", None)
    return sampler if hasattr(sampler, "start_at_sample") else None


def invariant_position(sampler, epoch: int, micro: int, window_open: bool) -> dict | None:
    """What trainer.pt records of an invariant epoch saved inside it: where that epoch's windows began (``start``, a
    sample position of its order) and, at a window boundary, the position reached (``samples``); a stop inside a
    window has none (it resumes on the same world size only, at its micro-batch)."""
    if sampler is None or micro == 0 or sampler.epoch != epoch:
        return None
    return {"epoch": epoch, "start": sampler.start, "samples": None if window_open else sampler.sample_offset(micro)}


def invariant_resume(engine_state: dict, saved: dict | None, invariant: bool) -> tuple[dict, tuple[int, int] | None]:
    """The engine position and ``(epoch, sample position)`` where an invariant epoch's windows continue, or None.

    At a window boundary the rest of the epoch is laid out afresh from the sample reached, on any world size (the
    engine starts it at micro-batch 0): with ``keep_global_batch`` its windows are the ones the saved run had
    ahead. Inside a window (same world size) the epoch keeps its layout and the engine its micro-batch."""
    epoch, micro = int(engine_state["epoch_index"]), int(engine_state["micro_in_epoch"])
    mine = saved is not None and int(saved["epoch"]) == epoch and micro > 0
    if invariant != mine and micro > 0:
        was, now = ("invariant", "distributed") if mine else ("distributed", "invariant")
        raise ConfigError("data.sampler", f"is {now}, but the checkpoint was taken inside epoch {epoch} with "
                          f"data.sampler: {was}, whose position in the epoch means other samples",
                          f"resume it with data.sampler: {was}, or from a checkpoint taken at an epoch's end")
    if not mine:
        return engine_state, None
    if saved["samples"] is None:
        return engine_state, (epoch, int(saved["start"]))
    engine_state["micro_in_epoch"] = 0
    return engine_state, (epoch, int(saved["samples"]))
