"""checkpoint.async (docs/checkpoints.md#asynchronous-checkpoints): the same run with synchronous and with
background checkpoints saves the same states, bit for bit, and ends with the same weights; a resume from a
background checkpoint ends where the synchronous run ends. Rank 0 sleeps before writing each trainer.pt
(tests/slow_write_tasks.py), so training changes the parameters while a background checkpoint is being written:
only a copy taken at the step keeps the saved state that of its step."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import paths

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "slow_write_tasks:regression", args: {{dropout: 0.1, samples: 128}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 2}}
distributed: {{backend: {backend}, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 3, keep_last: 10, async: {background}}}
logging: {{progress: plain, tensorboard: "off"}}
"""
# 128 samples, 2 workers x 8: 8 micro-batches per rank per epoch; steps 8 + 4 = 12; checkpoints at steps 3, 6, 8
# (epoch end), 9 and 12 (and epoch end)


def accum(tmp, name, background, *extra, slow=0.0, backend="ddp"):
    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.format(out=tmp / name, background=str(background).lower(), backend=backend))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "SLOW_"))}
    env.update(PYTHONPATH=paths.ROOT + os.pathsep + paths.TESTS, SLOW_WRITE_S=str(slow))
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(path), *extra], cwd=paths.TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp / name, proc.stdout + proc.stderr


def assert_equal(a, b, where=""):
    """Every tensor equal bit for bit (dtype and shape too), every other value equal, at any depth."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def saved(run):
    """The checkpoints' names and each one's trainer.pt (with its FSDP2 shards, consolidated, under "fsdp")."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = run / "checkpoints"
    names = sorted(os.listdir(root))
    states = {}
    for name in names:
        states[name] = torch.load(root / name / "trainer.pt", weights_only=True)
        if (root / name / "fsdp").is_dir():
            dcp_to_torch_save(root / name / "fsdp", run / f"{name}-fsdp.pt")
            states[name]["fsdp"] = torch.load(run / f"{name}-fsdp.pt", weights_only=False)  # written just now
    return names, states


def test_background_checkpoints_save_the_synchronous_states_and_resume_to_the_same_weights(tmp_path):
    check_background_against_sync(tmp_path, "ddp", {"model", "optimizer", "engine", "rng", "lr_scheduler"})


@pytest.mark.slow
def test_fsdp2_background_checkpoints_through_dcp_async_save_equal_the_synchronous_ones(tmp_path):
    check_background_against_sync(tmp_path, "fsdp", {"fsdp", "engine", "rng", "lr_scheduler"})


def check_background_against_sync(tmp_path, backend, parts):
    sync, _ = accum(tmp_path, "sync", False, slow=0.5, backend=backend)
    background, text = accum(tmp_path, "background", True, slow=0.5, backend=backend)
    assert "checkpoint.async: a checkpoint is due while" in text  # a save did run beside training
    assert text.count("checkpoint.async: a checkpoint is due while") == 1, text  # said once
    names, states = saved(sync)
    assert names == ["step-00000003", "step-00000006", "step-00000008", "step-00000009", "step-00000012"]
    assert saved(background)[0] == names
    for name in names:  # model, optimizer, LR scheduler, engine position, every rank's RNG states
        state, other = states[name], saved(background)[1][name]
        assert set(state) == set(other) >= parts
        assert_equal(state, other, name)
    final = torch.load(sync / "model.pt", weights_only=True)
    assert_equal(final, torch.load(background / "model.pt", weights_only=True), "model.pt")
    # continued from a background checkpoint (into its own run directory): the synchronous run's weights
    resumed, _ = accum(tmp_path, "resumed", False, "--resume", str(background / "checkpoints" / "step-00000006"),
                       backend=backend)
    assert_equal(final, torch.load(resumed / "model.pt", weights_only=True), "resumed model.pt")


def test_deepspeed_with_async_checkpoints_is_refused_in_one_line_before_launch(tmp_path):
    config = tmp_path / "ds.yaml"
    config.write_text(open(os.path.join(paths.ROOT, "configs", "deepspeed.yaml")).read())
    env = {**os.environ, "PYTHONPATH": paths.ROOT}
    for command in (["check"], ["run"]):
        proc = subprocess.run([sys.executable, "-m", "launcher", *command, str(config), "--set",
                               "checkpoint.async=true", "--set", f"run.output_dir={tmp_path / 'out'}"],
                              cwd=paths.ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("error: checkpoint.async: is not supported with distributed.backend: deepspeed")
        assert "save_checkpoint writes its own shards synchronously" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing launched
