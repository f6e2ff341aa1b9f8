"""accum_sched.integrations.accelerate.make_engine under torchrun (2 gloo CPU ranks): a tiny GPT-2 on padded
sequences, schedule {1: 2, 2: 4} over epochs of 7 micro-batches per rank (partial windows of 1 and 3), on the objects
accelerator.prepare returned, against the plain-torch large-batch reference of tests/hf_reference.py; under
Accelerate's DDP (and its own accumulate() with a mutated factor, which must miss) and its FSDP2 plugin."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hf_reference as ref

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(out, variants) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ref.WORLD),
               os.path.join(TESTS, "accelerate_tasks.py"), str(out), *variants]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {v: [torch.load(out / f"{v}-{rank}.pt") for rank in range(ref.WORLD)] for v in variants}


@pytest.fixture(scope="module")
def reference():
    return ref.reference()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("accelerate"), ("ddp", "mutated"))


def _assert_reference(runs, params, steps):
    assert ref.gap({n: p for n, p in ref.make_model().named_parameters()}, params) > 1e-2  # training moved it
    for rank, got in enumerate(runs):
        for name, r in params.items():
            torch.testing.assert_close(got["params"][name], r, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
        assert got["steps"] == got["lr_steps"] == steps == 13  # the prepared scheduler stepped once per step


def test_ddp_every_rank_matches_the_reference(ddp, reference):
    params, steps = reference
    _assert_reference(ddp["ddp"], params, steps)
    for got in ddp["ddp"]:  # 42 micro-batches per rank: only the boundary ones all-reduced
        assert got["allreduces"] == 13


def test_accumulate_with_a_mutated_factor_misses_the_reference(ddp, reference):
    """The check above can fail: accumulate() divides a partial window by the configured factor, and averages
    per-micro-batch means; its prepared scheduler steps once per process per optimizer step."""
    params, _ = reference
    for got in ddp["mutated"]:
        assert ref.gap(got["params"], params) > 1e-3
        assert got["steps"] == 13 and got["lr_steps"] == 26


@pytest.mark.slow
def test_fsdp2_every_rank_matches_the_reference(tmp_path, reference):
    params, steps = reference
    runs = launch(tmp_path, ("fsdp2",))["fsdp2"]
    _assert_reference(runs, params, steps)
    for got in runs:  # the reduce-scatters of one gradient sync per optimizer step, none off the boundary
        assert got["per_sync"] >= 1
        assert got["reduce_scatters"] == got["per_sync"] * 13, (got["reduce_scatters"], got["per_sync"])
        assert got["allreduces"] == 0
