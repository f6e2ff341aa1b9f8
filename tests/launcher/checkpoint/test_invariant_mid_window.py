"""`data.sampler: invariant`, stopped inside a window (SIGTERM, a preemption) and resumed on the same 2 workers: the
checkpoint keeps the epoch's window layout and the open window's per-rank gradients, and the resumed run ends at
the rank-free reference (one process, each window the next 48 samples of the epoch's permutation in one batch).

61 samples, micro-batch 2, global_batch 48 (factor 12 on 2 workers): windows of 48 and 13 samples per epoch; a
micro-batch takes 0.3 s, so the signal 1 s in lands a few micro-batches into the first 3.6 s window.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
sys.path.insert(0, TESTS)
import scale_tasks  # noqa: E402

SAMPLES, GLOBAL, EPOCHS = 61, 48, 2
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "scale_tasks:slow_regression", args: {{samples: 61}}}}
data: {{micro_batch_size: 2, shuffle: true, sampler: invariant}}
accumulation: {{global_batch: 48}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: null
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 1000}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def launch(path, *args, env=None):
    full = {k: v for k, v in os.environ.items() if k not in ("LOADS_DIR", "SLOW_S", "STARTED")}
    full["PYTHONPATH"] = paths.ROOT + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "launcher", "run", path, *args], cwd=TESTS, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reference() -> dict:
    torch.manual_seed(0)
    task = scale_tasks.slow_regression(samples=SAMPLES)
    model, data = task["model"], task["dataset"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
        for first in range(0, SAMPLES, GLOBAL):
            idx = order[first:first + GLOBAL]
            x, y = data.x[idx], data.y[idx]
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean(-1).mean().backward()
            optimizer.step()
    return model.state_dict()


def test_a_stop_inside_a_window_resumes_there_and_ends_at_the_reference(tmp_path):
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(out=run))
    started = tmp_path / "started"
    proc = launch(str(path), env={"SLOW_S": "0.3", "STARTED": str(started)})
    deadline = time.monotonic() + 300
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.02)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out[-4000:]  # stopped by the signal, checkpoint committed
    (ckpt,) = glob.glob(str(run / "checkpoints" / "step-00000000-mb*"))
    with open(os.path.join(ckpt, "manifest.json")) as f:
        assert json.load(f)["partial_window"] is True
    stop = int(ckpt.rsplit("mb", 1)[1])
    assert 0 < stop < 12

    resumed = launch(str(path), "--resume")
    out = resumed.communicate(timeout=400)[0]
    assert resumed.returncode == 0, out[-4000:]
    assert f"micro-batch {stop} inside a window" in out
    model = torch.load(run / "model.pt", weights_only=True)
    want = reference()
    for k in want:
        torch.testing.assert_close(model[k], want[k], rtol=1e-5, atol=1e-6)
    with open(run / "summary.json") as f:
        summary = json.load(f)
    assert summary["optimizer_steps"] == 4 and summary["samples"] == EPOCHS * SAMPLES
