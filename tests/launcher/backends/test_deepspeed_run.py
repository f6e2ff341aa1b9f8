"""`accum-sched run` with DeepSpeed: every ZeRO stage equals the DDP run of the same config (real torchrun launches,
2 CPU workers, schedule {0: 1, 2: 2, 4: 4} with partial windows); the `deepspeed` launcher runs the worker too; bad
DeepSpeed configs stop before launch with one line and exit status 2."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

import paths
from launcher.cli import main as cli_main
from launcher.config import load_config

ROOT = paths.ROOT
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed (pip install -e .[deepspeed])")
SCHEDULE = {0: 1, 2: 2, 4: 4}
# 104 samples over 2 ranks = 52 each = 7 micro-batches of 8 (the last of 4): factor 2 and 4 leave partial windows
BASE = {
    "run": {"seed": 0, "epochs": 6},
    "task": {"target": "builtin:regression", "args": {"samples": 104}},
    "data": {"micro_batch_size": 8, "shuffle": True},
    "accumulation": {"schedule": SCHEDULE},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "lr_scheduler": None,
    "distributed": {"backend": "ddp", "nproc_per_node": 2},
    "logging": {"progress": "plain"},
}


def write_config(tmp, name: str, *, deepspeed=None, schedule=True, **sections) -> str:
    cfg = json.loads(json.dumps(BASE))  # deep copy
    cfg["run"]["output_dir"] = str(tmp / name)
    if deepspeed is not None:
        cfg["distributed"].update(backend="deepspeed", deepspeed_config=deepspeed)
    if not schedule:
        del cfg["accumulation"]
    for section, values in sections.items():
        cfg[section] = {**(cfg.get(section) or {}), **values}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "DS_ACCELERATOR": "cpu"}


def accum(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env())


def trained(run_dir: str, proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


@pytest.fixture(scope="module")
def ddp_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return trained(str(tmp / "ddp"), accum("run", write_config(tmp, "ddp")))


def assert_same_model(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for key in want:
        assert got[key].dtype == torch.float32, (what, key)
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=lambda m: f"{what} {key}: {m}")


def assert_follows_schedule(run_dir: str) -> None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    for epoch in range(6):
        factor = [f for k, f in SCHEDULE.items() if k <= epoch][-1]
        steps = [m for m in lines if m["epoch"] == epoch]
        assert {m["factor"] for m in steps} == {factor}
        assert len(steps) == math.ceil(7 / factor)
        assert sum(m["samples"] for m in steps) == 104


@needs_ds
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.slow
def test_deepspeed_run_equals_ddp_run(tmp_path, ddp_model, stage):
    if stage == 2:  # the shipped JSON file, as a path
        config = write_config(tmp_path, "ds", deepspeed=os.path.join(ROOT, "configs", "ds_zero2.json"))
    elif stage == 3:  # the schedule written inside the DeepSpeed JSON under our key, none in the YAML
        json_path = tmp_path / "zero3.json"
        json_path.write_text(json.dumps({"zero_optimization": {"stage": 3},
                                         "accum_sched": {"schedule": {str(k): v for k, v in SCHEDULE.items()}}}))
        config = write_config(tmp_path, "ds", deepspeed=str(json_path), schedule=False)
    else:  # inline mapping
        config = write_config(tmp_path, "ds", deepspeed={"zero_optimization": {"stage": stage}})
    run_dir = str(tmp_path / "ds")
    assert_same_model(trained(run_dir, accum("run", config)), ddp_model, f"ZeRO {stage} vs DDP")
    assert_follows_schedule(run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["backend"] == "deepspeed" and summary["optimizer_steps"] == 2 * 7 + 2 * 4 + 2 * 2
    if stage == 1:
        _deepspeed_launcher(tmp_path, run_dir, ddp_model)


def _deepspeed_launcher(tmp_path, run_dir: str, ddp_model) -> None:
    """The worker under DeepSpeed's own launcher (which passes --local_rank), from the resolved config."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        resolved = yaml.safe_load(f)
    resolved["run"]["output_dir"] = str(tmp_path / "ds_launcher")
    config = tmp_path / "ds_launcher.yaml"
    config.write_text(yaml.safe_dump(resolved))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([launcher, "--num_gpus", "2", "--master_port", str(port), "--module", "launcher.worker",
                           "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env(), "OMP_NUM_THREADS": "1"})
    assert_same_model(trained(str(tmp_path / "ds_launcher"), proc), ddp_model, "deepspeed launcher vs DDP")


# -- before launch ----------------------------------------------------------------------------------------------
def check(capsys, config: str) -> tuple[int, str]:
    code = cli_main(["check", config])
    return code, capsys.readouterr().err.strip()


def ds_json(tmp_path, content, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


BAD = [
    # (name, DeepSpeed JSON, YAML sections, expected field, words the message must hold)
    ("syntax", '{\n  "zero_optimization": {"stage": 2},\n  "gradient_clipping": 1.0,,\n}', {},
     "distributed.deepspeed_config", ["JSON syntax error", "line 3, column 28"]),
    ("gas", {"gradient_accumulation_steps": 2}, {},
     "distributed.deepspeed_config.gradient_accumulation_steps",
     ["at epoch 0 (factor 1)", "train_batch_size 32 vs micro 8 x factor 1 x world 2 = 16"]),
    ("tbs", {"train_batch_size": 32}, {}, "distributed.deepspeed_config.train_batch_size",
     ["at epoch 0", "32 vs micro 8 x factor 1 x world 2 = 16"]),
    ("tbs-later", {"train_batch_size": 16}, {}, "distributed.deepspeed_config.train_batch_size",
     ["at epoch 2", "16 vs micro 8 x factor 2 x world 2 = 32"]),
    ("micro", {"train_micro_batch_size_per_gpu": 4}, {},
     "distributed.deepspeed_config.train_micro_batch_size_per_gpu", ["4 disagrees with data.micro_batch_size = 8"]),
    ("our-key-conflict", {"accum_sched": {"schedule": {"0": 2}}}, {},
     "distributed.deepspeed_config.accum_sched.schedule", ["differs from accumulation.schedule"]),
    ("our-key-bad", {"accum_sched": {"schedule": {"0": 0}}}, {},
     "distributed.deepspeed_config.accum_sched.schedule", ["factor"]),
    ("our-key-unknown", {"accum_sched": {"shedule": {"0": 2}}}, {},
     "distributed.deepspeed_config.accum_sched.shedule", ["unknown key"]),
    ("bf16", {"bf16": {"enabled": True}}, {}, "run.precision", ["bf16"]),
    ("clipping", {"gradient_clipping": 1.0}, {"optimizer": {"max_grad_norm": 0.5}},
     "distributed.deepspeed_config.gradient_clipping", ["differs from optimizer.max_grad_norm 0.5"]),
    ("unmanaged", {"managed_gradient_accumulation": False}, {},
     "distributed.deepspeed_config.managed_gradient_accumulation", ["not supported"]),
    ("offload", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, {},
     "distributed.deepspeed_config.zero_optimization.offload_optimizer", ["not supported"]),
    ("stage", {"zero_optimization": {"stage": 4}}, {}, "distributed.deepspeed_config.zero_optimization.stage",
     ["4 is not 0, 1, 2 or 3"]),
    ("two-schedulers", {"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}},
     {"lr_scheduler": {"name": "cosine"}}, "lr_scheduler", ["brings its own \"optimizer\""]),
]


@pytest.mark.parametrize("name,content,sections,field,words", BAD, ids=[b[0] for b in BAD])
def test_bad_deepspeed_config_is_one_line_and_exit_2(tmp_path, capsys, name, content, sections, field, words):
    config = write_config(tmp_path, "bad", deepspeed=ds_json(tmp_path, content), **sections)
    code, err = check(capsys, config)
    assert code == 2, err
    assert err.startswith(f"error: {field}: ") and "\n" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_missing_json_file(tmp_path, capsys):
    code, err = check(capsys, write_config(tmp_path, "bad", deepspeed=str(tmp_path / "nope.json")))
    assert code == 2 and err.startswith("error: distributed.deepspeed_config: file ") and "not found" in err, err


@pytest.mark.slow
def test_run_stops_before_launch_and_check_never_imports_torch(tmp_path):
    config = write_config(tmp_path, "bad", deepspeed=ds_json(tmp_path, {"gradient_accumulation_steps": 4}))
    proc = accum("run", config, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: distributed.deepspeed_config.gradient_accumulation_steps: ")
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "bad")  # no worker, no run directory
    good = write_config(tmp_path, "good", deepspeed={"zero_optimization": {"stage": 2}})
    probe = ("import sys; from launcher.cli import main; code = main(['check', sys.argv[1]]); "
             "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'torch imported'; "
             # the DDP path never imports DeepSpeed either: worker, engine, back end
             "import torch, launcher.worker; from accum_sched import AccumulationEngine; "
             "AccumulationEngine(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)); "
             "assert 'deepspeed' not in sys.modules, 'deepspeed imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, good], cwd=ROOT, capture_output=True, text=True, env=env(),
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_existing_json_and_our_key_become_the_schedule(tmp_path):
    """A JSON's fixed accumulation is the constant schedule when the YAML has none; our key is the schedule."""
    fixed = load_config(write_config(tmp_path, "fixed", schedule=False,
                                     deepspeed=ds_json(tmp_path, {"gradient_accumulation_steps": 4}, "fixed.json")))
    assert fixed.schedule.milestones == ((0, 4),)
    by_batch = load_config(write_config(tmp_path, "tbs", schedule=False,
                                        deepspeed=ds_json(tmp_path, {"train_batch_size": 48}, "tbs.json")))
    assert by_batch.schedule.milestones == ((0, 3),)  # 48 = micro 8 x 3 x world 2
    ours = load_config(write_config(tmp_path, "ours", schedule=False, deepspeed=ds_json(
        tmp_path, {"accum_sched": {"schedule": "0:1,3:2"}, "zero_optimization": {"stage": 1}}, "ours.json")))
    assert ours.schedule.milestones == ((0, 1), (3, 2))
    assert os.path.isabs(ours.distributed.deepspeed_config)  # workers and resumes may start elsewhere


def test_deepspeed_config_handed_to_deepspeed():
    """What DeepSpeed receives: batch keys from the schedule, our key gone, no silent clipping at 1.0."""
    from launcher.backends import deepspeed as deepspeed_setup

    cfg = load_config(os.path.join(ROOT, "configs", "deepspeed.yaml"))
    ds = deepspeed_setup.deepspeed_config(cfg, 2, client_optimizer=True)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        16, 1, 32)
    assert ds["gradient_clipping"] == 0.0 and "accum_sched" not in ds and ds["zero_optimization"]["stage"] == 2


def test_deepspeed_throughput_timer_off_unless_the_json_asks(tmp_path):
    """DeepSpeed's throughput timer synchronises the device at every forward and step(): off by default, the
    user's own "timers" section kept as written."""
    from launcher.backends import deepspeed as deepspeed_setup

    cfg = load_config(os.path.join(ROOT, "configs", "deepspeed.yaml"))
    assert deepspeed_setup.deepspeed_config(cfg, 2, client_optimizer=True)["timers"] == {
        "throughput": {"enabled": False}}
    asked = {"timers": {"throughput": {"enabled": True, "synchronized": False}}, "zero_optimization": {"stage": 2}}
    cfg = load_config(write_config(tmp_path, "timed", deepspeed=ds_json(tmp_path, asked, "timed.json")))
    assert deepspeed_setup.deepspeed_config(cfg, 2, client_optimizer=True)["timers"] == asked["timers"]
