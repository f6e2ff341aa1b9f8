"""A stop inside a window under the sharded back ends (issue 26 item 4): `accum-sched run` on 2 gloo workers gets
SIGTERM about 1.5 s into a 9.6 s window (16 micro-batches of 0.6 s); the workers commit a checkpoint holding each
rank's accumulated gradient of the open window (``window-rank<R>.pt``, manifest ``partial_window``) well before the
window would have closed, and the resumed run ends equal to the uninterrupted run of the same back end (bit for bit
where the back end allows it, else within 1e-5) and to the DDP run of the same config (the large-batch reference,
tests/launcher/train/test_scale_costs.py). A resume of that checkpoint on another world size is refused before
launch (exit 2).

FSDP2 in both gradient-sync modes (the unsharded accumulation and the sharded .grad) and with keep_gathered (the
parameters still gathered at the stop); DeepSpeed at ZeRO 0, 1, 2 and 3 in fp32 and with bf16 weights (DeepSpeed's
default bf16 accumulation), and at ZeRO 1, 2 and 3 with bf16 weights and fp32 accumulation (BF16_Optimizer's flat
buffer, ZeRO 2's compact partition buffers, ZeRO 3's fp32 partition buffer). A bf16 run ends bit for bit at the
uninterrupted bf16 run of the same config; its weights are ~1e-3 from the fp32 DDP run, which it matches in counts.

Uninterrupted runs that are bit for bit the same are made once (measured with torch 2.13 and DeepSpeed 0.19.8 on
CPU): in fp32, FSDP2 at the boundary, FSDP2 with keep_gathered, ZeRO 0 and ZeRO 1 reduce the window once, as DDP
does, and end bit for bit at the DDP run; FSDP2 every_micro_batch, ZeRO 2 and ZeRO 3 reduce every micro-batch and
end bit for bit at one another's run; with bf16 weights, ZeRO 2 and ZeRO 3 end at one another's run (in either
accumulation dtype). A resume is held to that run bit for bit; should a new torch or DeepSpeed make the back ends
of a group differ, ``UNINTERRUPTED`` is where each back end gets its own run again.
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

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2, precision: {precision}}}
task: {{target: "scale_tasks:slow_regression"}}
data: {{micro_batch_size: 2, shuffle: true}}
accumulation: {{unit: tokens, schedule: {{0: 16, 64: 4}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 1}}
distributed: {{{distributed}}}
checkpoint: {{every_n_steps: 1000, keep_last: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""
# 64 samples, 2 workers x 2: 16 micro-batches per rank per epoch. Epoch 1 is one window of 16; then factor 4.

DDP = "backend: ddp, nproc_per_node: 2"
FSDP_BOUNDARY = "backend: fsdp, nproc_per_node: 2, fsdp: {wrap: [Linear]}"
FSDP_EVERY = "backend: fsdp, nproc_per_node: 2, fsdp: {gradient_sync: every_micro_batch, wrap: [Linear]}"
FSDP_KEPT = "backend: fsdp, nproc_per_node: 2, fsdp: {keep_gathered: true, wrap: [Linear]}"


def launch(tmp, name, distributed, *args, env=None, wait=True, precision="fp32"):
    path = os.path.join(tmp, f"{name}.yaml")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(CONFIG.format(out=os.path.join(tmp, name), distributed=distributed, precision=precision))
    full = {k: v for k, v in os.environ.items() if k not in ("LOADS_DIR", "SLOW_S", "STARTED")}
    full["PYTHONPATH"] = os.path.dirname(TESTS) + os.pathsep + full.get("PYTHONPATH", "")
    full.setdefault("DS_ACCELERATOR", "cpu")
    full.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", path, *args], cwd=TESTS, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=500)
    return proc.returncode, out


def final(tmp, name):
    model = torch.load(os.path.join(tmp, name, "model.pt"), weights_only=True)
    with open(os.path.join(tmp, name, "summary.json")) as f:
        return model, json.load(f)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``get(distributed, precision)``: the uninterrupted run of that back end, made once for the back ends whose
    runs are bit for bit the same (the module docstring); ``get(DDP)`` equals the large-batch reference
    (test_scale_costs)."""
    made = {}

    def get(distributed, precision="fp32"):
        key = UNINTERRUPTED.get((distributed, precision), (distributed, precision))
        if key not in made:
            tmp = str(tmp_path_factory.mktemp("uninterrupted"))
            status, out = launch(tmp, "ref", key[0], precision=key[1])
            assert status == 0, out[-4000:]
            made[key] = final(tmp, "ref")
        return made[key]

    return get


@pytest.fixture(scope="module")
def ddp(uninterrupted):
    return uninterrupted(DDP)


def stopped_inside_a_window_then_resumed(tmp, distributed, ref, bitwise, ddp_ref, precision="fp32"):
    """The shared scenario (see the module docstring); ``ref``: the uninterrupted run of ``distributed`` (in
    ``precision``; a bf16 run is compared to the DDP run in its counts only: its weights differ from fp32 by ~1e-3)."""
    started = os.path.join(tmp, "started")
    proc = launch(tmp, "run", distributed, env={"SLOW_S": "0.6", "STARTED": started}, wait=False, precision=precision)
    deadline = time.monotonic() + 400
    while not os.path.exists(started):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.02)
    time.sleep(1.5)  # ~2.5 micro-batches into the first window (16 x 0.6 s)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    pattern = os.path.join(tmp, "run", "checkpoints", "step-00000000-mb*")
    committed = None
    while proc.poll() is None:
        if committed is None and glob.glob(os.path.join(pattern, "manifest.json")):
            committed = time.monotonic() - signalled
        time.sleep(0.02)
    out = proc.communicate()[0]
    assert proc.returncode == 75, out[-4000:]  # stopped by a signal, checkpoint committed
    assert committed is not None and committed < 6.0, (committed, out[-3000:])  # the window had 8 s to go
    (ckpt,) = glob.glob(pattern)
    stop = int(ckpt.rsplit("mb", 1)[1])
    assert 2 <= stop <= 8, ckpt  # ~2.5 micro-batches in at the signal, +1 to agree: far from 16
    assert {"manifest.json", "window-rank0.pt", "window-rank1.pt"} <= set(os.listdir(ckpt))
    with open(os.path.join(ckpt, "manifest.json")) as f:
        assert json.load(f)["partial_window"] is True
    assert "inside a window, after micro-batch" in out

    # the open window's gradients are per worker: another world size is refused before launch
    status, out = launch(tmp, "run", distributed, "--resume", "--nproc-per-node", "1", "--set",
                         "checkpoint.on_world_change=keep_factor")
    assert status == 2 and out.startswith("error: checkpoint.on_world_change: ") and "inside an accumulation window" \
        in out and len(out.strip().splitlines()) <= 2, out

    status, out = launch(tmp, "run", distributed, "--resume")
    assert status == 0, out[-4000:]
    assert f"micro-batch {stop} inside a window" in out
    got, summary = final(tmp, "run")
    ref_model, ref_summary = ref
    for k in ref_model:
        if bitwise:
            assert torch.equal(got[k], ref_model[k]), k
        else:
            torch.testing.assert_close(got[k], ref_model[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
        if precision == "fp32":
            torch.testing.assert_close(got[k], ddp_ref[0][k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k} vs DDP: {m}")
    for key in ("optimizer_steps", "micro_batches", "samples", "elements"):
        assert summary[key] == ref_summary[key] == ddp_ref[1][key], key


@pytest.mark.parametrize("distributed", (FSDP_BOUNDARY, FSDP_EVERY, FSDP_KEPT),
                         ids=("boundary", "every_micro_batch", "keep_gathered"))
def test_fsdp2_stops_inside_a_window_and_resumes_bit_for_bit(tmp_path, uninterrupted, ddp, distributed):
    stopped_inside_a_window_then_resumed(str(tmp_path), distributed, uninterrupted(distributed), bitwise=True,
                                         ddp_ref=ddp)


def zero(stage: int) -> str:
    return f"backend: deepspeed, nproc_per_node: 2, deepspeed_config: {{zero_optimization: {{stage: {stage}}}}}"


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_deepspeed_stops_inside_a_window_and_resumes_exactly(tmp_path, uninterrupted, ddp, stage):
    pytest.importorskip("deepspeed")
    stopped_inside_a_window_then_resumed(str(tmp_path), zero(stage), uninterrupted(zero(stage)), bitwise=True,
                                         ddp_ref=ddp)


def zero_bf16(stage: int) -> str:
    return (f"backend: deepspeed, nproc_per_node: 2, deepspeed_config: {{zero_optimization: {{stage: {stage}}}, "
            f"bf16: {{enabled: true}}}}")


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_deepspeed_bf16_stops_inside_a_window_and_resumes_bit_for_bit(tmp_path, uninterrupted, ddp, stage):
    """bf16 weights (DeepSpeed's default grad_accum_dtype: bf16): the window accumulates where it does in fp32, in
    bf16; the resume ends bit for bit at the uninterrupted bf16 run of the same stage."""
    pytest.importorskip("deepspeed")
    stopped_inside_a_window_then_resumed(str(tmp_path), zero_bf16(stage), uninterrupted(zero_bf16(stage), "bf16"),
                                         bitwise=True, ddp_ref=ddp, precision="bf16")


def zero_bf16_fp32_accum(stage: int) -> str:
    return (f"backend: deepspeed, nproc_per_node: 2, deepspeed_config: {{zero_optimization: {{stage: {stage}}}, "
            f"bf16: {{enabled: true}}, data_types: {{grad_accum_dtype: fp32}}}}")


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_deepspeed_bf16_fp32_accumulation_stops_inside_a_window_and_resumes_bit_for_bit(tmp_path, uninterrupted,
                                                                                       ddp, stage):
    """bf16 weights, fp32 accumulation (``data_types.grad_accum_dtype: fp32``): ZeRO 1 runs BF16_Optimizer (its flat
    fp32 gradient buffer), ZeRO 2 the compact fp32 partition buffers, ZeRO 3 an fp32 flat partition buffer."""
    pytest.importorskip("deepspeed")
    distributed = zero_bf16_fp32_accum(stage)
    stopped_inside_a_window_then_resumed(str(tmp_path), distributed, uninterrupted(distributed, "bf16"),
                                         bitwise=True, ddp_ref=ddp, precision="bf16")


# back end -> the back end whose uninterrupted run it ends at bit for bit (the module docstring)
UNINTERRUPTED = {
    **{(d, "fp32"): (DDP, "fp32") for d in (FSDP_BOUNDARY, FSDP_KEPT, zero(0), zero(1))},
    **{(d, "fp32"): (FSDP_EVERY, "fp32") for d in (zero(2), zero(3))},
    (zero_bf16(3), "bf16"): (zero_bf16(2), "bf16"),
    (zero_bf16_fp32_accum(3), "bf16"): (zero_bf16_fp32_accum(2), "bf16"),
}
