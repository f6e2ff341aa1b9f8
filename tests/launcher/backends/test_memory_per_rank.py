"""Memory per rank under FSDP2, counted from the tensors (deterministic; bench/memory.py measures RSS and the peak).

1. The launcher's FSDP2 setup (launcher/backends/fsdp.py) with AdamW, after a window of factor 2: the bytes of this
   rank's parameters, gradients and optimizer state on 2 ranks are at most half the 1-rank figure plus the shards'
   padding, and no full-size plain tensor of a parameter's shape outlives the setup (the model materialised before
   fully_shard must be gone, on every rank).
2. The host allocator settings `accum-sched run` gives its workers (launcher/launch/malloc.py): without them FSDP2's
   peak RSS at 20.7M parameters was 1.7x its own with them and above DDP's (docs/performance.md, "Memory").
"""
from __future__ import annotations

import gc
import os
import types

import pytest
import torch
from torch import nn

from distributed import spawn
from launcher.launch import malloc

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

WIDTH = 64


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def _worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from accum_sched import AccumulationEngine
    from launcher.backends.fsdp import FSDPBackend
    from launcher.config import FSDP_SCHEMA

    fsdp = {**{k: f.default for k, f in FSDP_SCHEMA.items()}, "wrap": ["Linear"]}
    cfg = types.SimpleNamespace(run=types.SimpleNamespace(compile=False, precision="fp32"),
                                distributed=types.SimpleNamespace(fsdp=fsdp))
    shapes = {tuple(p.shape) for p in model().parameters()}
    setup = FSDPBackend().setup(cfg, model(), lambda m: (torch.optim.AdamW(m.parameters(), lr=1e-3), None),
                                torch.device("cpu"), world)
    gc.collect()
    full = sum(o.untyped_storage().nbytes() for o in gc.get_objects()  # plain tensors of a parameter's full shape
               if type(o) in (torch.Tensor, nn.Parameter) and tuple(o.shape) in shapes and o.numel() > 4 * WIDTH)
    engine = AccumulationEngine(setup.module, schedule=2, **setup.engine_args)
    seen, at_step = set(), {}

    def measure(*_):
        params = list(setup.model.parameters())
        at_step.update(dtensors=all(isinstance(p, DTensor) for p in params), params=storage_bytes(params, seen),
                       grads=storage_bytes((p.grad for p in params), seen),
                       optim=storage_bytes((v for s in setup.optimizer.state.values() for v in s.values()), seen))

    setup.optimizer.register_step_post_hook(measure)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]
    for x, y in engine.micro_batches(batches, 0):
        engine.backward(((setup.module(x) - y) ** 2).sum(), y.numel())
    torch.save({"full_after_setup": full, "steps": engine.optimizer_steps, **at_step},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = {}
    for world in (1, 2):
        where = str(tmp_path_factory.mktemp(f"memory{world}"))
        spawn(_worker, world, where, deadline_s=300)
        out[world] = [torch.load(os.path.join(where, f"rank{r}.pt")) for r in range(world)]
    return out


def test_fsdp2_state_per_rank_halves_on_two_ranks(measured):
    one = measured[1][0]
    assert one["steps"] == 1 and one["dtensors"]
    numel = sum(p.numel() for p in model().parameters())
    # one rank: fp32 parameters, gradients and AdamW's two moments (plus its step counters)
    assert one["params"] == one["grads"] == 4 * numel
    assert 8 * numel <= one["optim"] <= 8 * numel + 64 * 8
    total_one = one["params"] + one["grads"] + one["optim"]
    padding = 4 * 4 * WIDTH * 4  # FSDP2 pads each shard to the same rows: under one row of each of the parameters
    for rank, r in enumerate(measured[2]):
        assert r["steps"] == 1 and r["dtensors"], rank
        total = r["params"] + r["grads"] + r["optim"]
        assert total <= total_one / 2 + padding, (rank, total, total_one)
        assert r["params"] <= one["params"] / 2 + padding / 4, (rank, r["params"], one["params"])


def test_no_full_copy_of_the_model_outlives_the_setup(measured):
    # on 2 ranks every plain tensor of a parameter's full shape is a leftover (on 1 rank the shards have that shape)
    for rank, r in enumerate(measured[2]):
        assert r["full_after_setup"] == 0, (rank, r["full_after_setup"])


def test_workers_get_the_allocator_settings(monkeypatch, tmp_path):
    env = malloc.worker_env({"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"
    # the user's own settings stay, ours are added beside them
    env = malloc.worker_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0" and env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    env = malloc.worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == ("glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=1048576:"
                                     "glibc.malloc.hugetlb=1")
    # and `accum-sched run` hands them to torchrun (its launch replaced by a recorder)
    from launcher import cli
    from launcher.cli import run

    seen = {}
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(run.forward, "call", lambda argv, env: (seen.update(env), (0, []))[1])
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "fsdp.yaml")
    assert cli.main(["run", config, "--set", f"run.output_dir={tmp_path / 'run'}"]) == 0
    assert seen["GLIBC_TUNABLES"] == malloc.worker_env({})["GLIBC_TUNABLES"]
