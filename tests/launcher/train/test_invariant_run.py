"""`data.sampler: invariant` under `accum-sched run` (torchrun, gloo): 1, 2 and 3 workers train the same steps.

101 samples, micro-batch 4, accumulation.global_batch 24 (factor 6, 3 and 2 on 1, 2 and 3 workers), 2 epochs of
shuffled order: windows of 24, 24, 24, 24 and a partial one of 5, which 2 and 3 workers split unevenly (an empty
micro-batch on the last rank at the boundary). The reference is one process that never hears of ranks: each window
is the next 24 samples of the epoch's permutation (seed + epoch) in one batch, the mean loss over them, one step.
A run stopped mid-epoch on 2 workers and resumed on 1 (keep_global_batch) matches it too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import paths

TESTS = paths.TESTS
sys.path.insert(0, TESTS)
import faulty_tasks  # noqa: E402

SAMPLES, GLOBAL, EPOCHS = 101, 24, 2
CONFIG = """\
run: {{output_dir: {out}, seed: 3, epochs: 2}}
task: {{target: "faulty_tasks:regression", args: {{samples: 101}}}}
data: {{micro_batch_size: 4, shuffle: true, sampler: invariant}}
accumulation: {{global_batch: 24}}
optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}
lr_scheduler: null
distributed: {{backend: {backend}, nproc_per_node: {world}}}
checkpoint: {{every_n_steps: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def accum(*args, fault=None, expect=0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env["PYTHONPATH"] = paths.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(fault or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=400)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def write_config(tmp_path, world: int, backend: str = "ddp") -> tuple[str, str]:
    run = str(tmp_path / f"run{world}")
    path = tmp_path / f"w{world}.yaml"
    path.write_text(CONFIG.format(out=run, world=world, backend=backend))
    return str(path), run


def reference() -> dict:
    torch.manual_seed(3)  # run.seed: the launcher seeds torch before the task builds its model
    task = faulty_tasks.regression(samples=SAMPLES)
    model, data = task["model"], task["dataset"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        for first in range(0, SAMPLES, GLOBAL):
            x, y = data[order[first:first + GLOBAL]]
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean(-1).mean().backward()
            optimizer.step()
    return model.state_dict()


def check_run(run: str, world: int) -> None:
    model = torch.load(os.path.join(run, "model.pt"), weights_only=True)
    want = reference()
    for k in want:
        torch.testing.assert_close(model[k], want[k], rtol=1e-5, atol=1e-6)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert [m["samples"] for m in metrics] == [24, 24, 24, 24, 5] * 2  # the window's samples, whatever the world
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert summary["world_size"] == world and summary["samples"] == EPOCHS * SAMPLES  # nothing padded or lost


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_world_size_trains_the_reference_steps(world, tmp_path):
    cfg, run = write_config(tmp_path, world)
    accum("run", cfg)
    check_run(run, world)


@pytest.mark.slow
def test_fsdp2_on_two_workers_trains_the_reference_steps(tmp_path):
    cfg, run = write_config(tmp_path, 2, "fsdp, fsdp: {wrap: [Linear]}")
    accum("run", cfg)
    check_run(run, 2)


@pytest.mark.slow
def test_two_workers_stopped_mid_epoch_resume_on_one(tmp_path):
    cfg, run = write_config(tmp_path, 2)
    # rank 0's 10th micro-batch: epoch 0, inside window 4 (factor 3); the last checkpoint is step 2 (48 samples)
    accum("run", cfg, fault={"FAULT_MODE": "raise", "FAULT_RANK": "0", "FAULT_AT": "10",
                             "FAULT_MARKER": str(tmp_path / "marker")}, expect=None)
    assert sorted(os.listdir(os.path.join(run, "checkpoints")))[-1] == "step-00000002"
    proc = accum("run", cfg, "--resume", "--nproc-per-node", "1", "--set",
                 "checkpoint.on_world_change=keep_global_batch")
    assert "epoch 0, sample 48 of its order" in proc.stdout + proc.stderr
    check_run(run, 1)


def test_too_small_asks_only_for_one_sample_under_invariant():
    from launcher.train.data_size import too_small

    # 3 samples over 4 ranks at micro-batch 8: DistributedSampler's shares cannot fill one with drop_last; the
    # invariant sampler gives every rank its window's micro-batches (empty ones run as zero-weighted fillers)
    assert "data.micro_batch_size" in str(too_small("t", 3, 4, 8, True))
    assert too_small("t", 3, 4, 8, False, "invariant") is None
    assert "0 samples" in str(too_small("t", 0, 4, 8, False, "invariant"))


@pytest.mark.slow
def test_a_stream_is_refused_by_the_workers_in_one_line(tmp_path):
    cfg, run = write_config(tmp_path, 2)
    done = accum("run", cfg, "--set", "task.target=stream_tasks:numbers", "--set", "task.args={length: 40}",
                 expect=2)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: data.sampler: invariant needs a map-style dataset (it slices each epoch's order), but "
                      "the task's dataset is a stream; set data.sampler: distributed"], done.stderr[-4000:]
    assert not os.path.exists(os.path.join(run, "model.pt"))
