"""Equivalence cases: data, models, the engine run on each rank, and the plain-torch large-batch reference.

The reference is written independently of the engine: for each window it concatenates every rank's micro-batches of
that window into one batch, takes the mean loss over its elements, and steps a single-process optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from accum_sched import AccumulationSchedule

VOCAB, PAD = 11, 0


@dataclass
class Case:
    name: str
    schedule: object
    epochs: int
    samples: tuple  # samples per rank, indexed by rank (cycled); unequal sizes give unequal short last batches
    micro: int = 4
    optimizer: str = "sgd"
    clip: float | None = None
    kind: str = "regression"  # or "tokens" (variable length, padding excluded), "unused" (unused parameters),
    # "layers" (a deeper regression MLP: several DDP buckets)
    lr: float = 0.05
    extra: dict = field(default_factory=dict)


def rank_batches(case: Case, rank: int, epoch: int) -> list:
    """The micro-batches rank ``rank`` sees in ``epoch``: deterministic, different per rank and epoch."""
    n = case.samples[rank % len(case.samples)]
    g = torch.Generator().manual_seed(1000 * epoch + 17 * rank + 3)
    out = []
    for start in range(0, n, case.micro):
        b = min(case.micro, n - start)
        if case.kind == "tokens":
            lengths = torch.randint(1, 9, (b,), generator=g)
            tokens = torch.randint(1, VOCAB, (b, 9), generator=g)
            mask = torch.arange(9)[None, :] < lengths[:, None]
            tokens = torch.where(mask, tokens, torch.full_like(tokens, PAD))
            out.append((tokens, mask))
        else:
            x = torch.randn(b, 6, generator=g)
            y = torch.randn(b, 2, generator=g)
            out.append((x, y))
    return out


class UnusedBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        self.unused = nn.Linear(6, 2)

    def forward(self, x):
        return self.body(x)


class TinyLM(nn.Module):
    """Predicts the next token from the current one and a causal running mean: padding must not leak in."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        e = self.emb(tokens)
        running = torch.cumsum(e, 1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]
        return self.out(torch.cat([e, running], -1))


def make_model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    if case.kind == "tokens":
        return TinyLM()
    if case.kind == "unused":
        return UnusedBranch()
    if case.kind == "layers":  # several DDP buckets with a small bucket_cap_mb (tests/accum_sched/test_perf_counts.py)
        return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                             nn.Linear(64, 2))
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(case: Case, model: nn.Module):
    if case.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=case.lr * 0.2, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=case.lr, momentum=0.9)


def element_losses(model, batch, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element losses and a mask of the elements that count."""
    if kind == "tokens":
        tokens, mask = batch
        logits = model(tokens[:, :-1])
        target = tokens[:, 1:]
        valid = mask[:, 1:]
        losses = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
        return losses, valid.reshape(-1)
    x, y = batch
    losses = ((model(x) - y) ** 2).sum(-1)
    return losses, torch.ones_like(losses, dtype=torch.bool)


def loss_fn_for(kind: str):
    def loss_fn(model, batch):
        losses, valid = element_losses(model, batch, kind)
        return (losses * valid).sum(), valid.sum()

    return loss_fn


def run_engine(case: Case, rank: int, world: int, carrier: bool = False, **engine_kwargs):
    """Train ``case`` with the engine on this rank (DDP when world > 1, built by ``accum_sched.wrap_ddp`` with
    ``carrier``); return (model, engine)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine, wrap_ddp

    model = make_model(case)
    wrap = wrap_ddp if carrier else DDP
    wrapped = wrap(model, find_unused_parameters=case.kind == "unused") if world > 1 else model
    optimizer = make_optimizer(case, model)
    engine = AccumulationEngine(wrapped, optimizer, case.schedule, max_grad_norm=case.clip, **engine_kwargs)
    loss_fn = loss_fn_for(case.kind)
    for epoch in range(case.epochs):
        engine.train_epoch(rank_batches(case, rank, epoch), loss_fn, epoch)
    return model, engine


def reference(case: Case, world: int) -> nn.Module:
    """Plain torch, one process: one large batch per window, made of every rank's micro-batches of that window."""
    return reference_units(case, "epoch", "none", world)


def window_reference(case: Case, world: int, *, optimizer=None, scheduler=None, skip=(),
                     hold_lr=False) -> tuple[nn.Module, list]:
    """Plain torch, one process, an epoch-keyed schedule: one large batch per window of every rank's micro-batches,
    clipped as the case says; ``optimizer(model)`` / ``scheduler(opt)`` replace the case's optimizer and add an LR
    scheduler stepped once per window; windows in ``skip`` ((epoch, index)) take no optimizer step (their data is
    consumed, the optimizer's state is not touched) and, with ``hold_lr`` (fp16 overflows), do not step the LR
    scheduler either. Returns the model and the LR each window ran with."""
    schedule = AccumulationSchedule(case.schedule)
    model = make_model(case)
    opt = optimizer(model) if optimizer else make_optimizer(case, model)
    sched = scheduler(opt) if scheduler else None
    lrs = []
    for epoch in range(case.epochs):
        per_rank = [rank_batches(case, r, epoch) for r in range(world)]
        n, factor = min(len(b) for b in per_rank), schedule.factor(epoch)
        for index, start in enumerate(range(0, n, factor)):
            window = [per_rank[r][i] for r in range(world) for i in range(start, min(start + factor, n))]
            big = (torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]))
            losses, valid = element_losses(model, big, case.kind)
            opt.zero_grad()
            losses[valid].mean().backward()
            if case.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            lrs.append(opt.param_groups[0]["lr"])
            if (epoch, index) not in skip:
                opt.step()
            if sched is not None and not (hold_lr and (epoch, index) in skip):
                sched.step()
    return model, lrs


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


CASES = [
    Case("sgd-changing-partial", {0: 1, 1: 2, 2: 3, 4: 5}, epochs=6, samples=(37, 39, 38)),
    Case("adamw-clip", {0: 1, 1: 2, 2: 3, 4: 5}, epochs=6, samples=(37, 39, 38), optimizer="adamw", clip=0.5),
    Case("sgd-clip-short-epoch", {0: 2, 1: 16}, epochs=3, samples=(21, 18, 23), clip=0.3),
    Case("tokens-adamw", {0: 2, 2: 3}, epochs=4, samples=(26, 27, 25), kind="tokens", optimizer="adamw", clip=1.0),
    Case("unused-params", "0:1,1:3", epochs=3, samples=(30, 29, 31), kind="unused"),
]


# (case, unit, LR coupling): schedules keyed by steps, samples and tokens; the reference is reference_units()
UNIT_CASES = [
    (Case("step-ramp", {"ramp": {"start": 1, "end": 3, "over": 5}}, epochs=3, samples=(37, 39, 38)), "step",
     "none"),
    (Case("tokens", {0: 1, 150: 2, 400: 3}, epochs=3, samples=(26, 27, 25), kind="tokens", optimizer="adamw",
          clip=1.0), "tokens", "none"),
    (Case("samples-linear-lr", "0:1,40:2,100:4", epochs=3, samples=(37, 39, 38)), "samples", "linear"),
    (Case("step-sqrt-lr", {0: 1, 3: 4}, epochs=2, samples=(37, 39, 38), optimizer="adamw"), "step", "sqrt"),
]


def brute_factor(schedule, value):
    keys = [k for k, _ in schedule.milestones if k <= value]
    return dict(schedule.milestones)[max(keys)] if keys else 1


def reference_units(case, unit, coupling, world):
    """The large-batch reference for schedules keyed by epochs, steps, samples or tokens, with optional LR coupling:
    its own counters, a brute-force factor lookup, one big batch per window (sequences of a window share one padded
    length, so token batches concatenate too)."""
    schedule = AccumulationSchedule(case.schedule, unit)
    model = make_model(case)
    optimizer = make_optimizer(case, model)
    base_lr = [g["lr"] for g in optimizer.param_groups]
    first = brute_factor(schedule, 0)
    counters = {"epoch": 0, "step": 0, "samples": 0, "tokens": 0}
    for epoch in range(case.epochs):
        counters["epoch"] = epoch
        per_rank = [rank_batches(case, r, epoch) for r in range(world)]
        n = min(len(b) for b in per_rank)
        start = 0
        while start < n:
            factor = brute_factor(schedule, counters[unit])
            window = [per_rank[r][i] for r in range(world) for i in range(start, min(start + factor, n))]
            big = (torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]))
            losses, valid = element_losses(model, big, case.kind)
            loss = losses[valid].mean()
            optimizer.zero_grad()
            loss.backward()
            if case.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            ratio = factor / first
            scale = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[coupling]
            for group, lr in zip(optimizer.param_groups, base_lr):
                group["lr"] = lr * scale
            optimizer.step()
            counters["step"] += 1
            counters["samples"] += len(big[0])
            counters["tokens"] += int(valid.sum())
            start += factor
    return model


def launcher_shards(dataset, world: int, micro: int, epoch: int, seed: int = 0) -> list[list[list[int]]]:
    """The micro-batches (lists of dataset indices) each rank of an `accum-sched run` trains in ``epoch``: torch's own
    DistributedSampler shards (shuffled, padded to equal length), cut into micro-batches of ``micro``."""
    from torch.utils.data import DistributedSampler

    shards = []
    for rank in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        idx = list(sampler)
        shards.append([idx[i:i + micro] for i in range(0, len(idx), micro)])
    return shards


def deepspeed_local_weights(ds_engine) -> dict:
    """This rank's own working weights of a DeepSpeed engine, without a collective: name -> (flat values, offset into
    the flattened full parameter). Full parameters at ZeRO 0-2 (offset 0); at ZeRO 3 the partition this rank holds
    (consolidated state dicts are gathered, so they cannot show one rank's weights going astray)."""
    import torch.distributed as dist

    out = {}
    for name, param in ds_engine.module.named_parameters():
        if hasattr(param, "ds_tensor"):  # ZeRO 3: a padded partition of the flattened parameter
            part = param.ds_tensor.detach().reshape(-1)
            start = part.numel() * dist.get_rank()
            out[name] = (part[:max(0, min(part.numel(), param.ds_numel - start))].float().clone(), start)
        else:
            out[name] = (param.detach().reshape(-1).float().clone(), 0)
    return out
