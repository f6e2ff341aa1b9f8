"""FSDP2 on a 2-D mesh (HSDP: 2 replicas x 2 shards, 4 real gloo ranks) in the three gradient-sync modes, with and
without ``keep_gathered``: every rank's parameters equal the plain-torch large-batch reference, and the collectives
each micro-batch launches are the mode's, counted by the test around torch.distributed (tests/counters.py), per
process group.

The case: SGD with momentum and clipping (so the global norm over the shards must count each shard once, not once
per replica; AdamW would hide that, being nearly blind to the gradient's scale), a schedule 1 -> 3 -> 2 whose
factor-3 epoch ends in a partial window, unequal loaders truncated to the shortest.

What each check catches: a mode that all-reduces off the boundary (or never), a norm summed over the
replicas' identical shards (sqrt(2) too large: the clipped steps differ), a window divided by the wrong count, kept
parameters not resharded at the boundary (the next window would run on stale parameters).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import cases
from counters import CollectiveCounter
from distributed import spawn

WORLD, MESH = 4, (2, 2)
CASE = cases.Case("hsdp-sgd-clip", {0: 1, 1: 3, 2: 2}, epochs=3, samples=(37, 39, 38, 30), optimizer="sgd",
                  clip=0.3)
MODES = ("boundary", "every_micro_batch", "reduce_scatter")
RUNS = [(mode, keep) for mode in MODES for keep in (False, True)]


class GroupCounter(CollectiveCounter):
    """The tests' collective counter, also noting the process group of each call by name."""

    def __init__(self):
        super().__init__()
        self.group_names: list[str | None] = []

    def _record(self, label, tensor, group_name, via):
        super()._record(label, tensor, group_name, via)
        self.group_names.append(group_name)


def shard(model: nn.Module, mesh) -> nn.Module:
    """fully_shard each Linear, then the root, on the 2-D mesh (FSDP2 then shards on dim 1, replicates on dim 0)."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules())[1:]:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(rank: int, mode: str, keep: bool, mesh) -> dict:
    from accum_sched import AccumulationEngine

    model = shard(cases.make_model(CASE), mesh)
    optimizer = cases.make_optimizer(CASE, model)
    engine = AccumulationEngine(model, optimizer, CASE.schedule, max_grad_norm=CASE.clip, gradient_sync=mode,
                                keep_gathered=keep)
    loss_fn = cases.loss_fn_for(CASE.kind)
    groups = {mesh.get_group("shard").group_name: "shard", mesh.get_group("replicate").group_name: "replicate"}
    micro, counted = [], GroupCounter()
    with counted:
        for epoch in range(CASE.epochs):
            for i, batch in enumerate(engine.micro_batches(cases.rank_batches(CASE, rank, epoch), epoch)):
                start = len(counted.calls)
                loss, n = loss_fn(model, batch)
                engine.backward(loss, n)
                micro.append({"epoch": epoch, "index": i, "start": start})
    calls = [(name, groups.get(group, "other")) for (name, _), group in zip(counted.calls, counted.group_names)]
    for m, following in zip(micro, micro[1:] + [None]):  # a micro-batch's forward, backward and window end
        m["calls"] = calls[m.pop("start"):len(calls) if following is None else following["start"]]
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()], "micro_batches": micro,
            "steps": engine.optimizer_steps}


def _worker(rank: int, world: int, out: str) -> None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    runs = {f"{mode}/{keep}": train(rank, mode, keep, mesh) for mode, keep in RUNS}
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hsdp"))
    spawn(_worker, WORLD, out, deadline_s=600)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def reference() -> tuple[list[torch.Tensor], int]:
    """The large-batch reference, and how many of its windows were clipped (the norm's check needs some)."""
    clipped = []
    original = torch.nn.utils.clip_grad_norm_

    def watch(parameters, max_norm, *args, **kwargs):
        norm = original(parameters, max_norm, *args, **kwargs)
        clipped.append(bool(norm > max_norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = watch
    try:
        model, _ = cases.window_reference(CASE, WORLD)
    finally:
        torch.nn.utils.clip_grad_norm_ = original
    return cases.params(model), sum(clipped)


@pytest.mark.parametrize("mode,keep", RUNS, ids=[f"{m}-{'kept' if k else 'resharded'}" for m, k in RUNS])
def test_every_rank_equals_large_batch_reference(launched, mode, keep):
    want, clipped = reference()
    assert clipped >= 3  # the norm decides some steps: a norm counting each shard twice would change them
    for rank, runs in enumerate(launched):
        got = runs[f"{mode}/{keep}"]["params"]
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda m: f"{mode} keep={keep} rank {rank} "
                                                                               f"param {i}: {m}")


def _closes_window(micro: list[dict]) -> list[tuple[bool, bool]]:
    """(opens its window, closes its window) for each micro-batch, from the schedule and the epochs' lengths."""
    from accum_sched import AccumulationSchedule

    schedule = AccumulationSchedule(CASE.schedule)
    length = {}
    for m in micro:
        length[m["epoch"]] = length.get(m["epoch"], 0) + 1
    out = []
    for m in micro:
        factor = schedule.factor(m["epoch"])
        out.append((m["index"] % factor == 0, (m["index"] + 1) % factor == 0 or m["index"] == length[m["epoch"]] - 1))
    return out


def _count(calls, name, group):
    return sum(1 for c in calls if c == (name, group))


@pytest.mark.parametrize("mode,keep", RUNS, ids=[f"{m}-{'kept' if k else 'resharded'}" for m, k in RUNS])
def test_collectives_per_micro_batch_follow_the_mode(launched, mode, keep):
    """Each of the 2 sharded Linears is one FSDP2 parameter group: per micro-batch it reduce-scatters (shard group)
    and all-reduces (replicate group) as the mode says, and all-gathers twice (forward, and again for the backward),
    or, kept gathered, once per window."""
    groups = 2
    for rank, runs in enumerate(launched):
        run = runs[f"{mode}/{keep}"]
        windows = _closes_window(run["micro_batches"])
        assert run["steps"] == sum(last for _, last in windows) == 8 + 3 + 4  # 8 micro-batches an epoch, factors 1 3 2
        for m, (first, last) in zip(run["micro_batches"], windows):
            where = (rank, mode, keep, m["epoch"], m["index"])
            calls = m["calls"]
            scatters = groups if last or mode != "boundary" else 0
            reduces = groups if last or mode == "every_micro_batch" else 0
            gathers = (groups if first else 0) if keep else 2 * groups
            assert _count(calls, "reduce_scatter", "shard") == scatters, (where, calls)
            assert _count(calls, "all_reduce", "replicate") == reduces, (where, calls)
            assert _count(calls, "all_gather", "shard") == gathers, (where, calls)
            # nothing else of the gradient's on the mesh's groups, and no gradient collective anywhere else
            assert all(g in ("shard", "replicate") or name == "all_reduce" for name, g in calls), (where, calls)
            assert len([c for c in calls if c[1] in ("shard", "replicate")]) == scatters + reduces + gathers, where
