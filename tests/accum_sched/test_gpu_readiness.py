"""Issue 18, the parts a CPU can prove: checkpoint coordination on its own gloo group outlasts the training timeout;
every rank must see the checkpoint rank 0 chose; DeepSpeed fp16 prescales (exact, and its loss scale does not back
off by the window size); pre-launch errors for fp16 with a DeepSpeed JSON that disagrees; the DeepSpeed JSON is
parsed once per process and deepspeed_setup no longer imports the config module.

DeepSpeed fp16 on CPU: DeepSpeed's CPU accelerator reports fp16 unsupported (it asks oneDNN, which has no fp16
kernels on this CPU) although torch computes in fp16 on CPU. The fp16 test claims the capability for its own worker
processes and runs DeepSpeed's real fp16 optimizers and loss scaler; nothing else is replaced.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import yaml

import cases
import paths
from distributed import attempt, spawn

ROOT = paths.ROOT
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
SHORT_S, SLOW_S = 2, 4  # the training group's timeout in the test, and how long rank 0 takes over a checkpoint


def small_config(tmp: str, **distributed):
    from launcher.config import validate

    return validate({"run": {"output_dir": tmp}, "task": {"target": "builtin:regression"},
                     "data": {"micro_batch_size": 4}, "distributed": {"nproc_per_node": 2, **distributed}})


# -- 18.3: coordination group ---------------------------------------------------------------------------------
def _coordination(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from launcher.checkpoint import coordination
    from launcher.checkpoint.checkpointer import Checkpointer

    # the training group as a worker has it, with a short timeout standing in for distributed.timeout_s
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=SHORT_S))
    group = coordination.start(timeout_s=60)
    ck = Checkpointer(small_config(out), rank, world)
    slow = lambda: time.sleep(SLOW_S) if rank == 0 else None  # noqa: E731 -- rank 0 hashing / fsyncing alone
    seen = os.path.join(out, "visible")
    if rank == 0:
        os.makedirs(seen, exist_ok=True)
    res = {
        "uses_group": ck.group is group and group is not None and group != dist.group.WORLD,
        "on_rank0": attempt(lambda: ck._on_rank0(lambda: slow() or "verified")),
        "together": attempt(lambda: ck._together("committing", slow)),
        # a rank that cannot see the directory rank 0 chose (here: rank 1 looks elsewhere) fails every rank
        "unseen": attempt(lambda: ck._together("resuming", lambda: ck._must_see(seen if rank == 0 else seen + "-x"))),
        # control: the same wait on the training group times out, so the checks above could fail
        "default": attempt(lambda: (slow(), dist.barrier())),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)  # the training group is broken by the control; spawn's closing barrier would fail on it


@pytest.mark.slow
def test_checkpoint_coordination_outlasts_the_training_timeout(tmp_path):
    spawn(_coordination, 2, str(tmp_path), deadline_s=240)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["uses_group"], rank
        assert res["on_rank0"]["error"] is None and res["on_rank0"]["result"] == "verified", res["on_rank0"]
        assert res["together"]["error"] is None, res["together"]
        assert res["on_rank0"]["seconds"] >= SLOW_S - 0.5 or rank == 0, res  # rank 1 really waited past SHORT_S
        error = res["unseen"]["error"]
        assert error and "rank 1" in error[1] and "shared by every node" in error[1], error
    control = json.loads((tmp_path / "rank1.json").read_text())["default"]
    assert control["error"] is not None and control["seconds"] < SLOW_S, control


def test_checkpoint_timeout_is_a_config_key(tmp_path):
    from launcher.errors import ConfigError

    cfg = small_config(str(tmp_path))
    assert cfg.checkpoint.timeout_s == 3600
    from launcher.config import validate

    with pytest.raises(ConfigError, match="checkpoint.timeout_s"):
        validate({"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 4},
                  "checkpoint": {"timeout_s": 1}})


# -- 18.4: DeepSpeed fp16 -------------------------------------------------------------------------------------
FP16_CASE = cases.CASES[0]  # sgd-changing-partial: factors 1..5, short last micro-batches (a correction != 1)


def _train_fp16(rank: int, stage: int, power: int, prescale: bool) -> dict:
    import deepspeed

    from accum_sched import AccumulationEngine
    from accum_sched.backends.deepspeed import consolidated_state_dict

    case = FP16_CASE
    model = cases.make_model(case)
    config = {"train_micro_batch_size_per_gpu": case.micro, "gradient_accumulation_steps": 1,
              "train_batch_size": case.micro * 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": power}}
    ds, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=cases.make_optimizer(case, model), config=config)
    engine = AccumulationEngine(ds, None, case.schedule, precision="fp16", micro_batch_size=case.micro)
    if not prescale:
        # the behaviour before the fix: backward of the window's raw sum
        engine.backend.capabilities = dataclasses.replace(engine.backend.capabilities, prescale=False)
    plain = cases.loss_fn_for(case.kind)

    def loss_fn(model, batch):
        return plain(model, (batch[0].half(), batch[1].half()))

    for epoch in range(case.epochs):
        engine.train_epoch(cases.rank_batches(case, rank, epoch), loss_fn, epoch)
    return {"state": consolidated_state_dict(ds, rank0_only=False), "local": cases.deepspeed_local_weights(ds),
            "scale": float(ds_opt.loss_scale), "skipped": engine.skipped_steps,
            "scaler": getattr(engine.backend, "scaler", None) is not None}


def _fp16_worker(rank: int, world: int, out: str) -> None:
    import logging

    os.environ["LOCAL_RANK"] = str(rank)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    import warnings

    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stage in (1, 3):  # a loss scale that never overflows here: the result must be the large batch's
            runs[f"z{stage}/exact"] = _train_fp16(rank, stage, power=10, prescale=True)
        for prescale in (True, False):  # a scale that must back off: by how much
            runs[f"z2/backoff/{prescale}"] = _train_fp16(rank, 2, power=20, prescale=prescale)
        runs["z0/refused"] = attempt(lambda: _train_fp16(rank, 0, power=10, prescale=True))
    torch.save(runs, os.path.join(out, f"fp16-{rank}.pt"))


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed (pip install -e .[deepspeed])")
@pytest.mark.slow
def test_deepspeed_fp16_prescales_exactly_and_keeps_its_loss_scale(tmp_path):
    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_torch_extensions_dir()
    spawn(_fp16_worker, 2, str(tmp_path), deadline_s=900)
    ranks = [torch.load(tmp_path / f"fp16-{rank}.pt", weights_only=False) for rank in range(2)]
    want = cases.reference(FP16_CASE, 2).state_dict()
    start = cases.make_model(FP16_CASE).state_dict()
    for rank, runs in enumerate(ranks):  # every rank: the gathered fp32 state and its own fp16 weights (or partition)
        for stage in (1, 3):
            run = runs[f"z{stage}/exact"]
            assert not run["scaler"] and run["skipped"] == 0, run  # no torch GradScaler next to DeepSpeed's scaler
            for key in want:
                moved = (want[key] - start[key]).abs().max().item()
                gap = (run["state"][key] - want[key]).abs().max().item()
                values, offset = run["local"][key]
                own = (values - want[key].reshape(-1)[offset:offset + values.numel()]).abs().max().item()
                # fp16 weights and activations: measured gap <= 6e-4; a wrong window coefficient moves them by ~moved
                assert max(gap, own) < 3e-3 and max(gap, own) < moved / 20, (rank, stage, key, gap, own, moved)
        fixed, raw = runs["z2/backoff/True"], runs["z2/backoff/False"]
        # measured: 16384 vs 2048 and 7 vs 10 skipped steps; the raw window sum is up to 20x the normalised gradient
        assert fixed["scale"] >= 4 * raw["scale"] and fixed["skipped"] < raw["skipped"], (rank, fixed["scale"],
                                                                                           raw["scale"])
        for name in ("z2/backoff/True", "z2/backoff/False"):  # one loss scale and one skip count on every rank
            assert (runs[name]["scale"], runs[name]["skipped"]) == (ranks[0][name]["scale"], ranks[0][name]["skipped"])
        refused = runs["z0/refused"]["error"]
        assert refused and "fp16 without ZeRO" in refused[1], (rank, refused)


def check(tmp_path, name: str, ds: dict, precision: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"output_dir": str(tmp_path / name), "precision": precision},
        "task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8},
        "distributed": {"backend": "deepspeed", "nproc_per_node": 2, "deepspeed_config": ds}}))
    return subprocess.run([sys.executable, "-m", "launcher", "check", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("name,ds,precision,field", [
    ("fp16-off", {"fp16": {"enabled": False}, "zero_optimization": {"stage": 2}}, "fp16", "fp16.enabled"),
    ("fp16-missing", {"zero_optimization": {"stage": 2}}, "fp16", "fp16.enabled"),
    ("bf16-on", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "fp16", "bf16.enabled"),
    ("zero0", {"fp16": {"enabled": True}}, "fp16", "zero_optimization.stage"),
    ("json-fp16", {"fp16": {"enabled": True}}, "bf16", None),
])
def test_fp16_with_a_disagreeing_deepspeed_json_stops_before_launch(tmp_path, name, ds, precision, field):
    proc = check(tmp_path, name, ds, precision)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    named = f"distributed.deepspeed_config.{field}" if field else "run.precision"
    assert proc.stderr.startswith(f"error: {named}: ") and proc.stderr.count("\n") == 1, proc.stderr


# -- 16.4: one parse of the DeepSpeed JSON, no import circle ------------------------------------------------------
def test_deepspeed_json_is_parsed_once_and_setup_does_not_import_config(tmp_path, monkeypatch):
    from launcher.backends import deepspeed as deepspeed_setup
    from launcher.config import load_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"accum_sched": {"schedule": {"0": 1, "2": 2}}, "zero_optimization": {"stage": 1}}))
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"output_dir": str(tmp_path / "run")}, "task": {"target": "builtin:regression"},
        "data": {"micro_batch_size": 8}, "distributed": {"backend": "deepspeed", "nproc_per_node": 2,
                                                          "deepspeed_config": str(ds)}}))
    reads = []
    real = deepspeed_setup.load_json
    monkeypatch.setattr(deepspeed_setup, "load_json", lambda cfg: reads.append(1) or real(cfg))
    cfg = load_config(str(cfg_path))  # resolves (twice: the schedule moves into the config)
    deepspeed_setup.validate(cfg, 2)  # what a worker does before deepspeed.initialize ...
    handed = deepspeed_setup.deepspeed_config(cfg, 2, client_optimizer=True)  # ... and what it hands DeepSpeed
    assert len(reads) == 1, reads
    assert cfg.schedule.milestones == ((0, 1), (2, 2)) and "accum_sched" not in handed
    probe = "import sys, launcher.backends.deepspeed; sys.exit('launcher.config' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
