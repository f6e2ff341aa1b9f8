"""`accum-sched run`'s work before the first worker starts (config, preflight, resume checks, device check, the
resolved config) imports neither torch nor DeepSpeed: it runs on login nodes, and torch's import (about 3 s) sat
on the path to the first worker. A device check asks torch only where the driver cannot answer
(launcher/launch/env.py: gpus_without_torch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import paths
from launcher.launch.env import gpus_without_torch

ROOT = paths.ROOT_PATH

# everything of `run` up to torchrun: forward.call is replaced by a recorder, then the modules are listed
PROBE = """
import json, sys
from launcher.launch import forward
seen = []
forward.call = lambda argv, env: (seen.append(argv), (0, []))[1]
from launcher.cli import main
rc = main(["run", *sys.argv[1:]])
print(json.dumps({"rc": rc, "launched": len(seen),
                  "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))}))
"""


def _prelaunch(tmp_path, *args, environ=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(environ or {})
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", ["demo.yaml", "deepspeed.yaml", "fsdp.yaml", "charlm.yaml"])
def test_run_prelaunch_imports_neither_torch_nor_deepspeed(tmp_path, config):
    # gloo: a device check that only warns never needs torch, on a GPU machine either
    out = _prelaunch(tmp_path, str(ROOT / "configs" / config), "--set", f"run.output_dir={tmp_path / 'run'}",
                     "--set", "distributed.process_group=gloo")
    assert out == {"rc": 0, "launched": 1, "imported": []}
    assert (tmp_path / "run" / "config.yaml").exists()  # the pre-launch work was done


def test_run_prelaunch_with_hidden_gpus_and_resume_stays_torch_free(tmp_path):
    """process_group auto with CUDA_VISIBLE_DEVICES='' (no GPU for certain) and --resume of committed
    checkpoints: the resume checks (manifest, checksums, config hash, world size) are torch-free too."""
    from launcher.checkpoint import store
    from launcher.config import load_config

    run_dir = tmp_path / "run"
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), [f"run.output_dir={run_dir}"])
    root = store.checkpoint_root(cfg)
    os.makedirs(root)
    tmp = os.path.join(root, "step-00000010.tmp")
    os.mkdir(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(os.urandom(64))
    store.commit(tmp, store.step_dir(root, 10),
                 {"format": store.FORMAT, "step": 10, "world_size": cfg.world_size, "factor_scale": [1, 1],
                  "config_hash": store.config_hash(cfg), "config": store.training_config(cfg)})
    out = _prelaunch(tmp_path, str(ROOT / "configs" / "demo.yaml"), "--set", f"run.output_dir={run_dir}",
                     "--resume", environ={"CUDA_VISIBLE_DEVICES": ""})
    assert out == {"rc": 0, "launched": 1, "imported": []}


@pytest.mark.parametrize("gpus, cvd, rocm, count", [
    (0, None, False, 0),  # no driver: no GPU, as torch would say
    (0, None, True, None),  # AMD's driver: only torch (ROCm) can count
    (4, None, False, 4),
    (4, "", False, 0),  # hidden
    (4, "-1", False, 0),
    (4, "2,3", False, 2),
    (4, "1,7,2", False, 1),  # CUDA stops at the first entry that is not a device
    (4, "0,0", False, None),  # repeated: left to torch
    (4, "GPU-8c6f6c2a-0000", False, None),  # UUIDs: left to torch
    (0, "0,1", False, 0),
])
def test_gpus_without_torch(tmp_path, gpus, cvd, rocm, count):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(gpus):
        (driver / f"0000:{i:02x}:00.0").mkdir()
    kfd = tmp_path / "kfd"
    if rocm:
        kfd.write_text("")
    environ = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert gpus_without_torch(environ, str(driver), str(kfd)) == count
