"""The one workload every variant trains: model, data, schedule and loss, plus the plain-torch reference.

Every variant sees exactly the same thing: an MLP of a given size, each rank's fixed synthetic data (the same every
epoch, no shuffling, every micro-batch full), and one schedule that walks through the measured factors epoch by
epoch after a warm-up epoch at factor 1. Epoch lengths are chosen so that factors 4 and 8 leave a partial last
window: that is where the peers' normalisation differs from one large batch, and the agreement column shows it.
"""
from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

D_IN, D_OUT = 256, 16
# width and hidden->hidden layers: about 1M and 20M parameters
MODELS = {"1M": (640, 2), "20M": (2240, 4)}
# Plain SGD at a low rate keeps training far from chaotic: two fp32 summation orders of the reference end
# ~1e-6 apart after the whole run, while the peers' partial-window error moves the parameters by ~1e-2, so the
# agreement column separates exact normalisation from that fault instead of measuring amplified rounding noise.
# (With momentum 0.9 at 1e-2 the rounding noise alone grew to 3e-3 over a few hundred steps.)
LR = 3e-4


@dataclass(frozen=True)
class Workload:
    model: str = "1M"
    micro: int = 32  # samples per micro-batch, per rank
    batches: int = 62  # micro-batches per rank per epoch
    factors: tuple = (1, 2, 4, 8)
    epochs_per_factor: int = 1
    world: int = 2

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        return cls(**{**data, "factors": tuple(data["factors"])})

    @property
    def epochs(self) -> int:
        return 1 + self.epochs_per_factor * len(self.factors)

    def factor_of_epoch(self, epoch: int) -> int:
        return 1 if epoch == 0 else self.factors[(epoch - 1) // self.epochs_per_factor]

    def schedule(self) -> dict[int, int]:
        """``{epoch: factor}`` with only the epochs where the factor changes (as Lightning wants it)."""
        out, last = {}, None
        for epoch in range(self.epochs):
            f = self.factor_of_epoch(epoch)
            if f != last:
                out[epoch], last = f, f
        return out

    def timed_epochs(self):
        """(epoch, factor) of every epoch that is timed: all but the warm-up epoch 0."""
        return [(e, self.factor_of_epoch(e)) for e in range(1, self.epochs)]


def build_model(name: str) -> nn.Module:
    width, depth = MODELS[name]
    torch.manual_seed(0)
    layers = [nn.Linear(D_IN, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, D_OUT))
    return nn.Sequential(*layers)


def param_count(name: str) -> int:
    width, depth = MODELS[name]
    return (D_IN + 1) * width + depth * (width + 1) * width + (width + 1) * D_OUT


def rank_data(w: Workload, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples (the same every epoch): ``batches * micro`` inputs and targets."""
    g = torch.Generator().manual_seed(1234 + rank)
    n = w.batches * w.micro
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randn(n, D_OUT, generator=g)
    return x, y


def rank_micro_batches(w: Workload, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (x, y) micro-batches of ``w.micro`` samples, in order."""
    x, y = rank_data(w, rank)
    return [(x[i:i + w.micro], y[i:i + w.micro]) for i in range(0, len(x), w.micro)]


def ab_inputs(model: str, batches: int, factors: str):
    """What a side-by-side A/B run starts from on this rank of a gloo group it joins: (rank, workload, this rank's
    micro-batches, the model's initial state every variant restarts from, the factors, a seeded order shuffler)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = Workload(model=model, batches=batches)
    initial = copy.deepcopy(build_model(w.model).state_dict())
    return rank, w, rank_micro_batches(w, rank), initial, [int(f) for f in factors.split(",")], random.Random(0)


def sample_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error per sample: the engine sums it, the usual loops take its mean per micro-batch."""
    return ((model(x) - y) ** 2).sum(-1)


def windowed(loader, factor: int):
    """The hand-written loops' window arithmetic: yields ``(batch, size, boundary)`` for each micro-batch, where
    ``size`` is the number of micro-batches in its window (a partial last window is shorter) and ``boundary`` marks
    the window's last micro-batch."""
    n = len(loader)
    for i, batch in enumerate(loader):
        start = i - i % factor
        size = min(factor, n - start)
        yield batch, size, i == start + size - 1


def make_optimizer(w: Workload, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def reference(w: Workload) -> list[torch.Tensor]:
    """Plain torch in this process: each window of the schedule as one large batch of every rank's micro-batches."""
    model = build_model(w.model)
    optimizer = make_optimizer(w, model.parameters())
    data = [rank_data(w, r) for r in range(w.world)]
    for epoch in range(w.epochs):
        factor = w.factor_of_epoch(epoch)
        for start in range(0, w.batches, factor):
            end = min(start + factor, w.batches) * w.micro
            x = torch.cat([d[0][start * w.micro:end] for d in data])
            y = torch.cat([d[1][start * w.micro:end] for d in data])
            optimizer.zero_grad()
            sample_losses(model, x, y).mean().backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]
