"""`accum-sched run` end to end: real torchrun launches with 2 workers, outputs checked against the schedule and a
plain-torch large-batch reference built from torch's own DistributedSampler shards."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import paths
from cases import launcher_shards
from launcher.tasks.builtin import regression

ROOT = paths.ROOT
ACCUM = [sys.executable, "-m", "launcher"]

REGRESSION = """\
run: {{output_dir: {out}, seed: 0, epochs: 4}}
task: {{target: builtin:regression, args: {{samples: 200}}}}
data: {{micro_batch_size: 16, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 3}}}}
optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
lr_scheduler: null
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain}}
"""


def accum(*args, cwd=ROOT, check=True, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(ACCUM + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def reference_regression(world=2, epochs=4, micro=16, schedule=((0, 1), (1, 2), (2, 3))):
    """One process: every window = one big batch of all ranks' micro-batches of that window; plain SGD."""
    torch.manual_seed(0)
    task = regression(samples=200)
    model, data = task["model"], task["dataset"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        factor = [f for k, f in schedule if k <= epoch][-1]
        shards = launcher_shards(data, world, micro, epoch)
        n = len(shards[0])
        for start in range(0, n, factor):
            idx = [i for r in range(world) for b in shards[r][start:start + factor] for i in b]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            loss = ((model(x) - y) ** 2).mean(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reg")
    cfg = tmp / "reg.yaml"
    cfg.write_text(REGRESSION.format(out=tmp / "run"))
    proc = accum("run", str(cfg))
    return tmp, str(cfg), str(tmp / "run"), proc


def test_run_outputs_follow_the_schedule(regression_run):
    _, _, run_dir, proc = regression_run
    assert {"config.yaml", "metrics.jsonl", "model.pt", "summary.json"} <= set(os.listdir(run_dir))
    lines = read_metrics(run_dir)
    batches = math.ceil(math.ceil(200 / 2) / 16)  # 7 micro-batches per rank per epoch, the last one short
    for epoch, factor in enumerate([1, 2, 3, 3]):
        rows = [r for r in lines if r["epoch"] == epoch]
        assert {r["factor"] for r in rows} == {factor}
        assert len(rows) == math.ceil(batches / factor)
        assert [r["micro_batches"] for r in rows] == [min(factor, batches - i) for i in range(0, batches, factor)]
        assert sum(r["elements"] for r in rows) == 200  # every sample once per epoch (100 per rank)
    for key in ("epoch", "step", "factor", "micro_batches", "elements", "loss", "lr", "grad_norm", "wall_time"):
        assert key in lines[0]
    assert [r["step"] for r in lines] == list(range(1, len(lines) + 1))
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["world_size"] == 2 and summary["epochs"] == 4
    assert summary["optimizer_steps"] == len(lines) == 7 + 4 + 3 + 3
    assert summary["micro_batches"] == 4 * batches and summary["elements"] == 800
    assert summary["allreduce_rounds"] == summary["optimizer_steps"]  # one gradient all-reduce per step
    assert summary["final_loss"] == pytest.approx(lines[-1]["loss"])
    # the stop poll's time floor (distributed.stop_poll_min_ms, default 100) thinned the poll: this model's
    # micro-batches take far less than 100 ms, and the factor-3 windows measured them
    assert summary["stop_poll_every"] > 1, summary["stop_poll_every"]
    assert "optimizer steps" in proc.stdout  # derived numbers printed at start, progress lines on rank 0


def test_run_matches_large_batch_reference(regression_run):
    _, _, run_dir, _ = regression_run
    got = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    ref = reference_regression()
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_agents_on_loopback_equal_one_node(regression_run):
    tmp, cfg, run_dir, _ = regression_run
    out = tmp / "two_nodes"
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": ROOT}
    agents = [subprocess.Popen(ACCUM + ["run", cfg, "--set", f"run.output_dir={out}", "--nnodes", "2",
                                        "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for rank in (0, 1)]
    for agent in agents:
        output, _ = agent.communicate(timeout=300)
        assert agent.returncode == 0, output[-4000:]
    one = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    two = torch.load(os.path.join(out, "model.pt"), weights_only=True)
    assert all(torch.equal(one[k], two[k]) for k in one)


CHARLM = """\
run: {{output_dir: {out}, seed: 1, epochs: 3}}
task: {{target: builtin:charlm, args: {{max_len: 32, d_model: 32, n_layers: 1}}}}
data: {{micro_batch_size: 8}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 4}}}}
optimizer: {{name: adamw, lr: 0.003}}
lr_scheduler: {{name: linear, warmup_steps: 2}}
distributed: {{nproc_per_node: 2}}
"""


@pytest.mark.slow
def test_charlm_is_token_normalised(tmp_path):
    cfg = tmp_path / "charlm.yaml"
    cfg.write_text(CHARLM.format(out=tmp_path / "run"))
    accum("run", str(cfg))
    lines = read_metrics(tmp_path / "run")
    assert [sorted({r["factor"] for r in lines if r["epoch"] == e}) for e in range(3)] == [[1], [2], [4]]
    assert all(r["elements"] > r["samples"] for r in lines)  # tokens, padding excluded, not sequences
    per_epoch = [sum(r["elements"] for r in lines if r["epoch"] == e) for e in range(3)]
    assert len(set(per_epoch)) == 1  # the same tokens every epoch, whatever the windows
    assert lines[-1]["loss"] < lines[0]["loss"]
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert any(k.startswith("tok.") for k in state)


USER_TASK = '''
import torch
from torch.utils.data import TensorDataset


def make(width=4):
    torch.manual_seed(0)
    x = torch.randn(40, width)
    model = torch.nn.Linear(width, 1)

    def loss_fn(model, batch):
        (inputs,) = batch
        return (model(inputs) ** 2).sum(), inputs.shape[0]

    return {"model": model, "dataset": TensorDataset(x), "loss_fn": loss_fn}
'''


@pytest.mark.slow
def test_user_task_from_module_path(tmp_path):
    (tmp_path / "my_tasks.py").write_text(USER_TASK)
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent("""\
        run: {output_dir: out, epochs: 2}
        task: {target: "my_tasks:make", args: {width: 3}}
        data: {micro_batch_size: 4}
        accumulation: {schedule: "0:3"}
        optimizer: {name: sgd, lr: 0.1}
        distributed: {nproc_per_node: 2}
        """))
    accum("run", "cfg.yaml", cwd=tmp_path)
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert summary["optimizer_steps"] == 2 * math.ceil(5 / 3)  # 20 samples per rank = 5 micro-batches
    assert torch.load(tmp_path / "out" / "model.pt", weights_only=True)["weight"].shape == (1, 3)
    bad = accum("run", "cfg.yaml", "--set", "task.target=my_tasks:missing", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: task.target: module 'my_tasks' has no function")


@pytest.mark.slow
def test_fresh_run_moves_old_checkpoints_aside(regression_run):
    tmp, cfg, _, _ = regression_run
    out = tmp / "again"
    for _ in range(2):
        proc = accum("run", cfg, "--set", f"run.output_dir={out}", "--set", "run.epochs=2", "--nproc-per-node", "1")
    aside = [p for p in os.listdir(out / "checkpoints") if p.startswith("superseded-")]
    assert len(aside) == 1 and os.listdir(out / "checkpoints" / aside[0]), os.listdir(out / "checkpoints")
    assert "moved" in proc.stderr and len(read_metrics(out)) == 13 + 7  # the second run's steps only (1 rank)


@pytest.mark.slow
def test_max_steps_ends_a_map_style_run_inside_an_epoch_and_is_the_lr_total(tmp_path):
    """run.max_steps: 9 of the 4 epochs' 7 + 4 + 3 + 3 steps: epoch 0 (factor 1, 7 steps) and 2 steps of epoch 1
    (factor 2); a linear LR decay spans those 9 steps (the total is min(planned, max_steps)); the run finishes
    normally (stopped_early false) with a checkpoint at step 9."""
    cfg = tmp_path / "reg.yaml"
    cfg.write_text(REGRESSION.format(out=tmp_path / "run").replace("epochs: 4}", "epochs: 4, max_steps: 9}").replace(
        "lr_scheduler: null", "lr_scheduler: {name: linear, min_lr: 0.0}"))
    proc = accum("run", str(cfg))
    lines = read_metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == list(range(1, 10))
    assert [m["factor"] for m in lines] == [1] * 7 + [2] * 2
    # LambdaLR: the LR of step s (1-based) is base x (1 - (s - 1) / 9)
    assert [round(m["lr"], 9) for m in lines] == [round(0.05 * (1 - s / 9), 9) for s in range(9)]
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert (summary["optimizer_steps"], summary["stopped_early"], summary["completed_epochs"]) == (9, False, 1)
    assert "step-00000009" in os.listdir(tmp_path / "run" / "checkpoints")
    assert "9 optimizer steps" in proc.stdout
    torch.manual_seed(0)
    task = regression(samples=200)
    model, data = task["model"], task["dataset"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 9)
    steps = 0
    for epoch, factor in ((0, 1), (1, 2)):
        shards = launcher_shards(data, 2, 16, epoch)
        for start in range(0, len(shards[0]), factor):
            if steps == 9:
                break
            idx = [i for r in range(2) for b in shards[r][start:start + factor] for i in b]
            loss = ((model(data.tensors[0][idx]) - data.tensors[1][idx]) ** 2).mean(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(trained[k], v, atol=1e-5, rtol=0)
