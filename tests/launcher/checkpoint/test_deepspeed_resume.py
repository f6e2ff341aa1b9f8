"""Resume at ZeRO 2: a DeepSpeed run that crashes mid-window resumes from its checkpoint (DeepSpeed's own sharded
files + accum-sched's position) and finishes with the same bits as the uninterrupted DeepSpeed run, which equals the
DDP run of the same config. The task has dropout (RNG state must come back) and a NaN sample (one skipped step per
epoch: DeepSpeed's overflow path, with the LR scheduler still stepped once per step as under DDP)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e .[deepspeed])", allow_module_level=True)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression", args: {{dropout: 0.1, nan_index: 37}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 3}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 2}}
distributed: {{{distributed}}}
checkpoint: {{every_n_steps: 4, keep_last: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""
ZERO2 = "backend: deepspeed, nproc_per_node: 2, deepspeed_config: {zero_optimization: {stage: 2}}"
# 256 samples, 2 workers x 8: 16 micro-batches per rank per epoch; steps 16 + 8 + 6 = 30, checkpoints every 4 steps.


def run(tmp, name: str, distributed: str = ZERO2, *extra, fault: dict | None = None, expect: int | None = 0):
    config = os.path.join(tmp, f"{name}.yaml")
    with open(config, "w") as f:
        f.write(CONFIG.format(out=os.path.join(tmp, name), distributed=distributed))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu", **(fault or {}))
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", config, *extra], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def outputs(run_dir: str):
    model = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        timing = ("wall_time", "samples_per_s", "tokens_per_s", "elapsed_s")  # differ between runs
        metrics = [{k: v for k, v in json.loads(line).items() if k not in timing} for line in f]
    return model, metrics


def test_zero2_crash_and_resume_equals_uninterrupted_run_and_ddp(tmp_path):
    tmp = str(tmp_path)
    run(tmp, "ref")
    ref_model, ref_metrics = outputs(os.path.join(tmp, "ref"))
    assert [m["step"] for m in ref_metrics if m["skipped"]] == [16, 17, 27]  # the NaN sample, once per epoch

    run(tmp, "ddp", "backend: ddp, nproc_per_node: 2")
    ddp_model, ddp_metrics = outputs(os.path.join(tmp, "ddp"))
    assert [m["lr"] for m in ref_metrics] == [m["lr"] for m in ddp_metrics]  # skipped steps advance the LR too
    assert [m["skipped"] for m in ref_metrics] == [m["skipped"] for m in ddp_metrics]
    for key in ddp_model:
        torch.testing.assert_close(ref_model[key], ddp_model[key], atol=1e-6, rtol=1e-5)

    marker = os.path.join(tmp, "marker")
    fault = {"FAULT_MODE": "raise", "FAULT_RANK": "0", "FAULT_AT": "45", "FAULT_MARKER": marker}  # epoch 2, mid-window
    crashed = run(tmp, "run", fault=fault, expect=None)
    assert crashed.returncode != 0 and "injected failure at micro-batch 45" in crashed.stdout + crashed.stderr
    checkpoints = sorted(os.listdir(os.path.join(tmp, "run", "checkpoints")))
    assert checkpoints[-1] == "step-00000028"
    assert os.path.isdir(os.path.join(tmp, "run", "checkpoints", "step-00000028", "deepspeed"))  # ZeRO shards

    resumed = run(tmp, "run", ZERO2, "--resume")
    assert "resumed from " + os.path.join(tmp, "run", "checkpoints", "step-00000028") in resumed.stdout
    model, metrics = outputs(os.path.join(tmp, "run"))
    assert json.dumps(metrics) == json.dumps(ref_metrics)  # NaN-safe: every step line, factor, LR, loss, norm
    for key in ref_model:
        assert torch.equal(model[key], ref_model[key]), key  # bit for bit
