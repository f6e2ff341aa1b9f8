"""Random number generator states across a checkpoint: saved as tensors and plain values (weights_only loading),
put back so that what a resumed run draws equals what the uninterrupted run drew."""
from __future__ import annotations

import random

import torch

try:  # its RNG is saved and seeded where it is installed (torch does not need it)
    import numpy as np
except ImportError:
    np = None


def rng_state(device: torch.device) -> dict:
    """This process's RNG states as tensors and plain values (safe for weights_only loading)."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "numpy" in state and np is not None:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank(seed: int, rank: int, step: int, device: torch.device) -> None:
    """A rank that has no saved RNG state (the world grew): a stream of its own, derived from seed, rank, step."""
    value = (seed * 1_000_003 + rank * 7919 + step) % 2**63
    random.seed(value)
    torch.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    if np is not None:
        np.random.seed(value % 2**32)


class RankRng:
    """One rank's RNG around checkpoints.

    The DataLoader draws its base seed from the global torch RNG when its iterator is made, so the state just before
    an epoch's ``iter()`` is recorded (:meth:`before_iter`): a checkpoint mid-epoch saves it with the current one.
    Resuming mid-epoch puts the epoch-start state back before ``iter()`` (the same base seed, so the same worker
    seeds) and the checkpoint's state right after it (:meth:`replay`), before the first micro-batch not trained yet
    is fetched.
    """

    def __init__(self, device: torch.device, seed: int, rank: int):
        self.device, self.seed, self.rank = device, seed, rank
        self.epoch_start: dict | None = None  # the state just before this epoch's iter()
        self._pending = None  # applied at the next epoch's iter(): a state dict, or a step to seed from
        self._replay: tuple[int, dict] | None = None  # (epoch, state) to put back right after that iter()

    def snapshot(self) -> dict:
        """What a checkpoint saves of this rank (gathered to rank 0 with every other rank's)."""
        return {"now": rng_state(self.device), "epoch_start": self.epoch_start}

    def plan(self, saved: list, mid_epoch: bool, epoch: int, step: int) -> None:
        """What this rank starts from: its own saved state (``mid_epoch`` on the same world: the epoch-start state
        before the loader's iter(), then the saved one), or a fresh stream when the world grew and it has none."""
        mine = saved[self.rank] if self.rank < len(saved) else None
        if mine is None:
            self._pending = step
        elif mid_epoch and mine.get("epoch_start") is not None:
            self._pending = mine["epoch_start"]
            self._replay = (epoch, mine["now"])
        else:
            self._pending = mine["now"]

    def before_iter(self) -> None:
        pending, self._pending = self._pending, None
        if isinstance(pending, dict):
            set_rng_state(pending, self.device)
        elif pending is not None:
            seed_rank(self.seed, self.rank, pending, self.device)
        self.epoch_start = rng_state(self.device)

    def replay(self, epoch: int) -> dict | None:
        """The state to put back right after ``epoch``'s iter() (once), or None."""
        if self._replay is None or self._replay[0] != epoch:
            return None
        state, self._replay = self._replay[1], None
        return state

    def restore(self, state: dict) -> None:
        set_rng_state(state, self.device)
