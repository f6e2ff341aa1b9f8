"""`accum-sched run` with `distributed.backend: fsdp` (real torchrun launches, 2 gloo workers, FSDP2 on CPU).

- both gradient-sync modes end where the DDP run of the same config ends (a regression with dropout, so the RNG
  matters, and a NaN sample, so a step is skipped in every epoch), with the same metrics; model.pt is a plain fp32
  state_dict with the unsharded keys, loadable with weights_only=True;
- a worker SIGKILLed mid-window: torchrun restarts the group, which resumes from the DCP checkpoint by itself and
  ends BIT FOR BIT where the uninterrupted FSDP2 run ends;
- 2 workers crash mid-epoch, 1 resumes (keep_global_batch; DCP reshards): equal to the plain-torch large-batch
  reference;
- bad distributed.fsdp fields are one line naming the field, exit 2, and `check` never imports torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_checkpoint import CONFIG, DROPOUT, accum, checkpoints, fault, outputs, reference_large_batch

import paths

ROOT = paths.ROOT


def write_config(tmp, name, backend="fsdp", fsdp="{wrap: [Linear]}", args=DROPOUT,
                 lr_scheduler="{name: cosine, warmup_steps: 2}"):
    text = CONFIG.format(out=os.path.join(tmp, name), args=args, lr_scheduler=lr_scheduler)
    distributed = f"distributed: {{backend: {backend}, nproc_per_node: 2" + (
        f", fsdp: {fsdp}}}" if backend == "fsdp" else "}")
    text = text.replace("distributed: {backend: ddp, nproc_per_node: 2}", distributed)
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The DDP run and the two FSDP2 runs of one config, uninterrupted."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for name, backend, fsdp in (("ddp", "ddp", None), ("boundary", "fsdp", "{wrap: [Linear]}"),
                                ("every", "fsdp", "{gradient_sync: every_micro_batch, wrap: auto}")):
        accum("run", write_config(tmp, name, backend, fsdp))
        out[name] = outputs(os.path.join(tmp, name))
    return out


@pytest.mark.parametrize("mode", ("boundary", "every"))
@pytest.mark.slow
def test_fsdp_run_equals_ddp_run(runs, mode):
    model, metrics, summary = runs[mode]
    ddp_model, ddp_metrics, ddp_summary = runs["ddp"]
    assert list(model) == list(ddp_model)  # no FSDP prefixes: the unsharded model's keys
    for key in ddp_model:
        assert model[key].dtype == torch.float32 and type(model[key]) is torch.Tensor, key
        torch.testing.assert_close(model[key], ddp_model[key], atol=1e-6, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    assert [m["skipped"] for m in metrics] == [m["skipped"] for m in ddp_metrics]  # steps 16, 17, 27
    assert [(m["factor"], m["samples"], m["lr"]) for m in metrics] == [
        (m["factor"], m["samples"], m["lr"]) for m in ddp_metrics]
    assert summary["backend"] == "fsdp" and summary["optimizer_steps"] == ddp_summary["optimizer_steps"] == 30
    micro = summary["micro_batches"]  # reduce-scatter rounds: one per step, or one per micro-batch
    assert summary["allreduce_rounds"] == (30 if mode == "boundary" else micro) and micro == 48


@pytest.mark.slow
def test_killed_worker_resumes_from_dcp_bit_for_bit(runs, tmp_path):
    cfg, run = write_config(tmp_path, "run"), os.path.join(tmp_path, "run")
    marker = tmp_path / "marker"
    proc = accum("run", cfg, "--max-restarts", "1", fault=fault("kill", 1, 46, marker))  # epoch 3, mid-window
    assert marker.read_text() == "kill at micro-batch 46\n"
    text = proc.stdout + proc.stderr
    # torchrun names the killed rank (-9), or, where it reaped the rank it stopped first (a CI run with two test
    # workers: rank 0's SIGTERM), that one (-15); the kill itself is the marker above
    assert "exitcode: -9" in text or "exitcode: -15) local_rank: 0" in text, text[-3000:]
    step28 = os.path.join(run, "checkpoints", "step-00000028")
    assert "resumed from " + step28 + " (step 28, epoch 2, micro-batch 12" in text
    shards = sorted(os.listdir(os.path.join(step28, "fsdp")))
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2  # one file per rank
    model, metrics, summary = outputs(run)
    ref_model, ref_metrics, ref_summary = runs["boundary"]
    for key in ref_model:
        assert torch.equal(model[key], ref_model[key]), key
    assert json.dumps(metrics) == json.dumps(ref_metrics)  # NaN-safe: every step line, factor, LR, loss, norm
    assert summary == ref_summary


@pytest.mark.slow
def test_resume_on_one_worker_reshards_and_keeps_the_global_batch(tmp_path):
    cfg = write_config(tmp_path, "run", fsdp="{gradient_sync: every_micro_batch, wrap: [Linear]}", args="{}",
                       lr_scheduler="null")
    run = os.path.join(tmp_path, "run")
    accum("run", cfg, fault=fault("raise", 0, 27, tmp_path / "marker"), expect=None)  # epoch 2, after step 21
    assert checkpoints(run)[-1] == "step-00000020"
    proc = accum("run", cfg, "--resume", "--nproc-per-node", "1", "--set",
                 "checkpoint.on_world_change=keep_global_batch")
    assert "the 128 samples not trained yet, re-dealt" in proc.stdout
    model, metrics, summary = outputs(run)
    assert [m["step"] for m in metrics] == list(range(1, 31)) and summary["world_size"] == 1
    want = reference_large_batch()
    for key in want:
        torch.testing.assert_close(model[key], want[key], rtol=1e-5, atol=1e-6)


BAD = [
    ("distributed.fsdp.gradient_sync=sometimes", "distributed.fsdp.gradient_sync", "not one of boundary"),
    ("distributed.fsdp.wrap=Linear", "distributed.fsdp.wrap", "expected 'auto' or a non-empty list"),
    ("distributed.fsdp.param_dtype=half", "distributed.fsdp.param_dtype", "not one of float32"),
    ("distributed.fsdp.reshard=true", "distributed.fsdp.reshard", "unknown key"),
    ("distributed.backend=ddp", "distributed.fsdp", "is set but distributed.backend is ddp"),
    ("run.precision=fp16", "run.precision", "not supported with backend: fsdp"),
]


def test_bad_fsdp_fields_are_one_line_and_check_never_imports_torch(tmp_path):
    cfg = write_config(tmp_path, "cfg")
    probe = ("import sys; from launcher.cli import main; code = main(['check', *sys.argv[1:]]); "
             "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for override, field, words in BAD:
        proc = subprocess.run([sys.executable, "-c", probe, cfg, "--set", override], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (override, proc.stdout, proc.stderr)
        assert proc.stderr.startswith(f"error: {field}: ") and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    good = subprocess.run([sys.executable, "-c", probe, os.path.join(ROOT, "configs", "fsdp.yaml")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stdout + good.stderr
