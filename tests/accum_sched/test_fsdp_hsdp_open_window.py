"""FSDP2 on a 2-D mesh (HSDP: 2 replicas x 2 shards, 4 real gloo ranks): a stop inside a window, in each of the three
gradient-sync modes, saves every rank's open window (engine ``state_dict``; accum_sched/backends/fsdp_window.py), and a
fresh model, optimizer and engine loaded from it (full model state, DCP's optimizer state dict) finish the epoch BIT
FOR BIT where the uninterrupted run ends. In ``reduce_scatter`` mode the window also lives in each parameter group's
reduce-scattered, not yet all-reduced, partial shard: restoring everything but that is checked to end elsewhere.

The stop is requested in the second window of 4 (after step 1: an optimizer that never stepped is the launcher's
business, launcher/backends/fsdp.py) and takes effect two micro-batches into it.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from distributed import spawn

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

WORLD = 4
MODES = ("boundary", "every_micro_batch", "reduce_scatter")


def _run(rank: int, world: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accum_sched import AccumulationEngine
    from accum_sched.backends import fsdp_window

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    batches = [(x[i:i + 2], y[i:i + 2]) for i in range(rank * 2, 64, 2 * world)]  # 8 per rank: 2 windows of 4

    def loss_fn(model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).sum(), batch[0].shape[0]

    def build(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, optimizer, AccumulationEngine(model, optimizer, {0: 4}, stop_at="micro_batch",
                                                    gradient_sync=mode)

    def full(model):
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    results = {}
    for mode in MODES:
        model, _, engine = build(mode)
        for batch in engine.micro_batches(batches, 0):
            engine.backward(*loss_fn(engine.model, batch))
        reference = full(model)

        model, optimizer, engine = build(mode)
        for i, batch in enumerate(engine.micro_batches(batches, 0)):
            if i == 4 and rank == 0:  # the second window's first micro-batch, one rank only
                engine.request_stop()
            engine.backward(*loss_fn(engine.model, batch))
        stopped = (engine.micro_in_epoch, engine.window_open, engine.optimizer_steps)
        saved = copy.deepcopy(engine.state_dict())
        model_state = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        optim_state = copy.deepcopy(get_optimizer_state_dict(model, optimizer))

        ends = {}
        for variant in ("all", "no_partial"):
            model, optimizer, engine = build(mode)
            set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
            set_optimizer_state_dict(model, optimizer, copy.deepcopy(optim_state))
            state = copy.deepcopy(saved)
            if variant == "no_partial":
                state["window"]["local_grads"]["partial"] = [None] * len(state["window"]["local_grads"]["partial"])
            engine.load_state_dict(state)
            for batch in engine.micro_batches(batches, 0):
                engine.backward(*loss_fn(engine.model, batch))
            got = full(model)
            ends[variant] = (engine.optimizer_steps, max(float((a - b).abs().max()) for a, b in zip(got, reference)))
        results[mode] = {"stopped": stopped, "ends": ends,
                         "has_partial": any(t is not None for t in saved["window"]["local_grads"]["partial"]),
                         "format": saved["window"]["local_grads"]["format"] == fsdp_window.FORMAT}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hsdp-open-window"))
    spawn(_run, WORLD, out, deadline_s=300)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("mode", MODES)
def test_hsdp_open_window_resumes_bit_for_bit(results, mode):
    for rank, per_rank in enumerate(results):
        r = per_rank[mode]
        assert r["format"], rank
        assert r["stopped"] == (6, True, 1), (rank, r["stopped"])  # two micro-batches into the second window
        assert r["ends"]["all"] == (2, 0.0), (rank, r["ends"])  # both steps taken, bit for bit
        assert r["has_partial"] == (mode == "reduce_scatter"), rank
        if mode == "reduce_scatter":  # the partial shard is part of the window: without it the run ends elsewhere
            assert r["ends"]["no_partial"][1] > 1e-4, (rank, r["ends"])
