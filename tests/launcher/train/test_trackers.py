"""logging.wandb and logging.mlflow (issue 28.2), with the real libraries and no network: wandb in offline mode,
MLflow on its file store under the run directory.

A 2-rank `accum-sched run` logs to both; read back, MLflow's run (its only run: rank 1 made none) holds every step's
loss at its step, equal to metrics.jsonl's, the evaluations under val/, the config as params and the summary; the
wandb offline run (the only one under the configured dir) holds the same history, config and summary in its .wandb
file. Rank 1 runs with wandb and mlflow made unimportable, so the run passing shows it never imports them. A run that
crashes and resumes continues the same tracker runs without logging a step twice. Bad keys and a missing package stop
before launch (exit 2, one line).
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

import paths
from launcher.config import trackers as tracker_config
from launcher.config.schema import validate
from launcher.errors import ConfigError

TESTS = paths.TESTS
ROOT = paths.ROOT

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "{target}", args: {args}}}
data: {{micro_batch_size: 16, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 4, keep_last: 5}}
logging:
  progress: plain
  tensorboard: "off"
  wandb: {{project: accum-test, mode: offline, tags: [ci, trackers]}}
  mlflow: {{experiment: accum-test, tags: {{team: ci}}}}
"""
# 256 samples, 2 ranks x 16: 8 micro-batches per rank per epoch; steps 8 (factor 1) + 4 (factor 2) = 12
STEPS = 12
# rank 1 may not import either tracker: with sys.modules[name] = None any `import wandb` there raises
SHIM = """\
import os, sys
if os.environ.get("RANK") == "1":
    sys.modules["wandb"] = None
    sys.modules["mlflow"] = None
"""


def write(tmp, name, target="builtin:regression", args="{samples: 256, val_samples: 64}", text=CONFIG):
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text.format(out=os.path.join(tmp, name), target=target, args=args))
    return path


def accum(tmp, *args, env_extra=None, expect=0):
    shim = os.path.join(tmp, "shim")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(SHIM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "WANDB_", "MLFLOW_"))}
    env["PYTHONPATH"] = os.pathsep.join([shim, ROOT, TESTS, env.get("PYTHONPATH", "")])
    # no network, nothing outside tmp: wandb offline and silent, its config and cache dirs in tmp
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp), WANDB_CONFIG_DIR=str(tmp / "wbcfg"),
               WANDB_CACHE_DIR=str(tmp / "wbcache"), WANDB_DATA_DIR=str(tmp / "wbdata"))
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=400)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mlflow_client(run_dir):
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri="file:" + os.path.join(os.path.abspath(run_dir), "mlruns"))


def mlflow_runs(run_dir):
    client = mlflow_client(run_dir)
    experiment = client.get_experiment_by_name("accum-test")
    assert experiment is not None
    return client, client.search_runs([experiment.experiment_id])


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# -- reading a wandb offline run: its .wandb file is a LevelDB-style log of protobuf Records -------------------------
def wandb_records(path):
    """The Records of a .wandb file (wandb 0.31 has no Python reader: the format is W&B's leveldb log: a 7-byte
    header, then 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1)`, FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def _key(item):
    return "/".join(item.nested_key) or item.key


def wandb_run(run_dir_path):
    """(run id, project, name, tags, config, {step: {key: value}}, summary) of one offline run directory."""
    name = next(n for n in os.listdir(run_dir_path) if n.endswith(".wandb"))
    rows, summary, config, run = {}, {}, {}, None
    for record in wandb_records(os.path.join(run_dir_path, name)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            rows[record.history.step.num] = {_key(i): json.loads(i.value_json) for i in record.history.item}
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
    assert run is not None
    return run.run_id, run.project, run.display_name, list(run.tags), config, rows, summary


def offline_runs(run_dir):
    base = os.path.join(run_dir, "wandb")
    return sorted(os.path.join(base, n) for n in os.listdir(base) if n.startswith("offline-run-"))


# -- one uninterrupted run ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    accum(tmp, "run", write(tmp, "run"))
    return os.path.join(tmp, "run")


def test_mlflow_run_holds_every_step_the_config_and_the_summary(run):
    client, runs = mlflow_runs(run)
    assert len(runs) == 1, [r.info.run_id for r in runs]  # rank 1 started none
    got = runs[0]
    saved = json.load(open(os.path.join(run, "trackers.json")))
    assert got.info.run_id == saved["mlflow"]
    assert got.info.run_name == "run" and got.info.status == "FINISHED"
    assert got.data.tags["team"] == "ci"
    lines = jsonl(os.path.join(run, "metrics.jsonl"))
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert history(client, got.info.run_id, "train/loss") == [(m["step"], m["loss"]) for m in lines]
    assert history(client, got.info.run_id, "train/factor") == [(m["step"], m["factor"]) for m in lines]
    evals = jsonl(os.path.join(run, "eval.jsonl"))
    assert len(evals) == 2  # after each epoch
    assert history(client, got.info.run_id, "val/val_loss") == [(e["step"], e["val_loss"]) for e in evals]
    params = got.data.params
    assert params["task.target"] == "builtin:regression"
    assert params["optimizer.lr"] == "0.01" and params["distributed.nproc_per_node"] == "2"
    assert json.loads(params["accumulation.schedule"]) == {"0": 1, "1": 2}
    assert params["distributed.fsdp.gradient_sync"] == "boundary"
    summary = json.load(open(os.path.join(run, "summary.json")))
    os.makedirs(os.path.join(run, "..", "dl"), exist_ok=True)
    local = client.download_artifacts(got.info.run_id, "summary.json", os.path.join(run, "..", "dl"))
    assert json.load(open(local)) == summary
    assert history(client, got.info.run_id, "summary/final_loss") == [(STEPS, summary["final_loss"])]


def test_wandb_offline_run_holds_the_same_history(run):
    dirs = offline_runs(run)
    assert len(dirs) == 1, dirs  # one run, rank 0's
    run_id, project, name, tags, config, rows, summary = wandb_run(dirs[0])
    assert run_id == json.load(open(os.path.join(run, "trackers.json")))["wandb"]
    assert dirs[0].endswith(run_id)
    assert (project, name, sorted(tags)) == ("accum-test", "run", ["ci", "trackers"])
    assert config["optimizer"]["lr"] == 0.01 and config["task"]["target"] == "builtin:regression"
    lines = jsonl(os.path.join(run, "metrics.jsonl"))
    assert sorted(s for s in rows if "train/loss" in rows[s]) == list(range(1, STEPS + 1))
    assert [rows[m["step"]]["train/loss"] for m in lines] == [m["loss"] for m in lines]
    for e in jsonl(os.path.join(run, "eval.jsonl")):
        assert rows[e["step"]]["val/val_loss"] == e["val_loss"]
    assert summary["final_loss"] == json.load(open(os.path.join(run, "summary.json")))["final_loss"]


# -- a crash and --resume: the same tracker runs, no step twice -----------------------------------------------------
@pytest.mark.slow
def test_resume_continues_the_same_tracker_runs(tmp_path):
    cfg, run = write(tmp_path, "crash", target="faulty_tasks:regression", args="{}"), os.path.join(tmp_path, "crash")
    # rank 0's 13th micro-batch (epoch 1, factor 2): step 11 never ends; the trackers have steps 1-10, the newest
    # checkpoint is step 8 (every 4 steps and the epoch's end), so the resume trains steps 9 and 10 again
    fault = {"FAULT_MODE": "raise", "FAULT_RANK": "0", "FAULT_AT": "13", "FAULT_MARKER": str(tmp_path / "marker")}
    crashed = accum(tmp_path, "run", cfg, env_extra=fault, expect=None)
    assert crashed.returncode != 0
    first = json.load(open(os.path.join(run, "trackers.json")))
    assert first["step"] == 10, first
    client, runs = mlflow_runs(run)
    assert [s for s, _ in history(client, first["mlflow"], "train/loss")] == list(range(1, 11))
    resumed = accum(tmp_path, "run", cfg, "--resume", env_extra=fault)
    assert "resumed from " + os.path.join(run, "checkpoints", "step-00000008") in resumed.stdout + resumed.stderr
    after = json.load(open(os.path.join(run, "trackers.json")))
    assert (after["mlflow"], after["wandb"]) == (first["mlflow"], first["wandb"])
    client, runs = mlflow_runs(run)
    assert [r.info.run_id for r in runs] == [first["mlflow"]]
    assert runs[0].info.status == "FINISHED"
    lines = jsonl(os.path.join(run, "metrics.jsonl"))
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    # every step once; steps 9-10 trained again after the resume give the same loss (exact resume)
    assert history(client, first["mlflow"], "train/loss") == [(m["step"], m["loss"]) for m in lines]
    dirs = offline_runs(run)
    assert len(dirs) == 2, dirs  # wandb offline: one directory per session, both of the same run id
    (id1, *_, rows1, _), (id2, *_, rows2, summary2) = wandb_run(dirs[0]), wandb_run(dirs[1])
    assert id1 == id2 == first["wandb"]
    assert sorted(rows1) == list(range(1, 11)) and sorted(rows2) == list(range(11, STEPS + 1))
    assert summary2["optimizer_steps"] == STEPS


# -- bad input before launch ----------------------------------------------------------------------------------------
def _cfg(logging: dict):
    return validate({"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 4}, "logging": logging})


@pytest.mark.parametrize("logging,field", [
    ({"wandb": {"projct": "p"}}, "logging.wandb.projct"),
    ({"wandb": {"name": "x"}}, "logging.wandb.project"),
    ({"wandb": {"project": "p", "mode": "offlin"}}, "logging.wandb.mode"),
    ({"wandb": {"project": "p", "tags": "a"}}, "logging.wandb.tags"),
    ({"wandb": ["p"]}, "logging.wandb"),
    ({"mlflow": {"experiment": "e", "uri": "file:/x"}}, "logging.mlflow.uri"),
    ({"mlflow": {"run_name": "r"}}, "logging.mlflow.experiment"),
    ({"mlflow": {"experiment": "e", "tags": 3}}, "logging.mlflow.tags"),
])
def test_bad_tracker_keys_name_the_key(logging, field):
    with pytest.raises(ConfigError) as err:
        _cfg(logging)
    assert err.value.field == field, err.value.line()


def test_unknown_key_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        _cfg({"wandb": {"project": "p", "projct": "q"}})
    assert "project, name, tags, mode, entity, dir" in err.value.line()


def test_defaults_follow_the_run_directory():
    cfg = validate({"run": {"output_dir": "/tmp/x/my-run"}, "task": {"target": "builtin:regression"},
                    "data": {"micro_batch_size": 4},
                    "logging": {"wandb": {"project": "p"}, "mlflow": {"experiment": "e", "tags": ["a"]}}})
    w, m = tracker_config.wandb_settings(cfg), tracker_config.mlflow_settings(cfg)
    assert (w["name"], w["dir"], w["mode"], w["tags"]) == ("my-run", "/tmp/x/my-run", "online", [])
    assert (m["run_name"], m["tracking_uri"], m["tags"]) == ("my-run", "file:/tmp/x/my-run/mlruns", {"a": "true"})


def test_missing_package_is_a_config_error():
    cfg = _cfg({"mlflow": {"experiment": "e"}})
    tracker_config.preflight(cfg)  # installed here: passes
    with pytest.raises(ConfigError) as err:
        tracker_config.preflight(cfg, find_spec=lambda name: None)
    assert err.value.line() == ("logging.mlflow: is set but the mlflow package is not installed; "
                                "pip install 'accum-sched[mlflow]', or set logging.mlflow: null")


def test_check_without_wandb_exits_2_with_one_line(tmp_path):
    """`accum-sched check` where wandb cannot be imported (sys.modules["wandb"] = None, as for rank 1 above)."""
    cfg = write(tmp_path, "nowandb")
    proc = accum(tmp_path, "check", cfg, env_extra={"RANK": "1"}, expect=2)
    assert proc.stderr.startswith("error: logging.wandb: is set but the wandb package is not installed; "
                                  "pip install 'accum-sched[wandb]'"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    ok = accum(tmp_path, "check", cfg)  # with wandb importable: the schedule table
    assert "OK" in ok.stdout


def test_wandb_disabled_needs_no_package():
    cfg = _cfg({"wandb": {"project": "p", "mode": "disabled"}})
    assert tracker_config.configured(cfg) == []
    tracker_config.preflight(cfg, find_spec=lambda name: None)


def test_check_imports_neither_torch_nor_the_trackers(tmp_path):
    cfg = write(tmp_path, "light")
    code = ("import sys; from launcher.cli import main; rc = main(['check', %r]); "
            "bad = [m for m in ('torch', 'wandb', 'mlflow') if m in sys.modules]; "
            "assert not bad, bad; sys.exit(rc)" % cfg)
    proc = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])})
    assert proc.returncode == 0, proc.stderr


# -- a preemption (SIGTERM to `accum-sched run`), then --resume ------------------------------------------------------
SLOW = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: "{target}", args: {args}}}
data: {{micro_batch_size: 2, shuffle: true}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging:
  progress: plain
  tensorboard: "off"
  mlflow: {{experiment: accum-test}}
"""
SLOW_STEPS = 16  # 64 samples, 2 ranks x 2, factor 1


@pytest.mark.slow
def test_preempted_run_is_killed_then_resumed_to_finished(tmp_path):
    import signal
    import time

    cfg = write(tmp_path, "slow", target="scale_tasks:slow_regression", args="{}", text=SLOW)
    run, state = os.path.join(tmp_path, "slow"), os.path.join(tmp_path, "slow", "trackers.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SLOW_S"))}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, TESTS]), SLOW_S="0.3")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", cfg], cwd=TESTS, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (os.path.exists(state) and json.load(open(state)).get("step", 0) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out[-4000:]
    stopped = json.load(open(state))
    assert 3 <= stopped["step"] < SLOW_STEPS, stopped
    client, runs = mlflow_runs(run)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(stopped["mlflow"], "KILLED")]
    env["SLOW_S"] = "0"
    done = subprocess.run([sys.executable, "-m", "launcher", "run", cfg, "--resume"], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client, runs = mlflow_runs(run)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(stopped["mlflow"], "FINISHED")]
    lines = jsonl(os.path.join(run, "metrics.jsonl"))
    assert [m["step"] for m in lines] == list(range(1, SLOW_STEPS + 1))
    assert history(client, stopped["mlflow"], "train/loss") == [(m["step"], m["loss"]) for m in lines]
