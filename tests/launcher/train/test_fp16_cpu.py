"""fp16 on CPU: torch.amp.GradScaler("cpu") and CPU float16 autocast run the whole loss-scaling path without a GPU.

- 2 gloo ranks, DDP, a step-keyed schedule, an LR changing every step, nonfinite='raise': rank 1's loss is blown
  up once, so the scaled backward overflows fp16. Every rank skips that step (never raises), counts it, halves the
  same loss scale, does not step the LR scheduler and does not advance the step-keyed schedule; the parameters equal
  a plain-torch fp16 large-batch reference (own GradScaler, same rules) at fp16 rounding.
- `accum-sched run` with precision: fp16 on 2 CPU workers: metrics.jsonl carries loss_scale, the overflow step is a
  counted skip, and evaluation runs under the same autocast.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
from torch import nn

import paths

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
import pytest

from distributed import attempt, spawn  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

MICRO, BATCHES, EPOCHS = 4, 6, 2
SCHEDULE = {0: 1, 3: 2}  # keyed by optimizer steps taken: an overflow step is not one
BLOW_UP = (1, 0, 2)  # (rank, epoch, micro-batch) whose loss is multiplied by 1e30
INIT_SCALE = 2.0 ** 16  # GradScaler's default


def batches(rank: int, epoch: int) -> list:
    g = torch.Generator().manual_seed(100 * epoch + 7 * rank)
    return [(torch.randn(MICRO, 6, generator=g) * 0.5, torch.randn(MICRO, 2, generator=g) * 0.1)
            for _ in range(BATCHES)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def per_sample(model, x, y):
    return ((model(x) - y) ** 2).mean(-1)


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine, AccumulationSchedule

    def train():
        model = make_model()
        opt, sched = make_optimizer(model)
        engine = AccumulationEngine(DDP(model), opt, AccumulationSchedule(SCHEDULE, "step"), lr_scheduler=sched,
                                    precision="fp16", nonfinite="raise", micro_batch_size=MICRO)
        steps, dtypes = [], set()
        engine.on_step(lambda i: steps.append([i.step, i.skipped, i.loss_scale, i.factor]))
        for epoch in range(EPOCHS):
            for index, batch in enumerate(engine.micro_batches(batches(rank, epoch), epoch)):
                with engine.autocast():
                    x, y = batch
                    out = engine.model(x)
                    dtypes.add(str(out.dtype))
                    loss = ((out - y) ** 2).mean(-1).sum()
                if (rank, epoch, index) == BLOW_UP:
                    loss = loss * 1e30
                engine.backward(loss, MICRO)
        torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"params-{rank}.pt"))
        return {"steps": steps, "dtypes": sorted(dtypes), "counters": engine.counters(),
                "scheduler_steps": sched.last_epoch, "scale": float(engine.backend.scaler.get_scale())}

    with open(os.path.join(out_dir, f"report-{rank}.json"), "w") as f:
        json.dump(attempt(train), f)


def reference(world: int = 2):
    """One process: each window is one fp16-autocast batch of every rank's micro-batches; its own GradScaler."""
    model = make_model()
    opt, sched = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    taken, steps = 0, []
    for epoch in range(EPOCHS):
        data = [batches(r, epoch) for r in range(world)]
        start = 0
        while start < BATCHES:
            factor = max(f for k, f in SCHEDULE.items() if k <= taken)
            window = range(start, min(start + factor, BATCHES))
            x = torch.cat([data[r][i][0] for r in range(world) for i in window])
            y = torch.cat([data[r][i][1] for r in range(world) for i in window])
            weight = torch.ones(len(x))
            for k, (r, i) in enumerate((r, i) for r in range(world) for i in window):
                if (r, epoch, i) == BLOW_UP:
                    weight[k * MICRO:(k + 1) * MICRO] = 1e30
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (per_sample(model, x, y) * weight).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < before
            if not skipped:  # as HF Trainer: the LR schedule and the step count wait for a real step
                sched.step()
                taken += 1
            steps.append([len(steps) + 1, skipped, before, factor])
            start += factor
    return model, steps, float(scaler.get_scale())


def test_fp16_overflow_is_a_counted_skip_agreed_by_every_rank():
    with tempfile.TemporaryDirectory() as out:
        spawn(_ranks, 2, out, deadline_s=600)
        reports = [json.load(open(os.path.join(out, f"report-{r}.json"))) for r in range(2)]
        params = [torch.load(os.path.join(out, f"params-{r}.pt")) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["error"] is None, (rank, report["error"])  # nonfinite='raise' and still no error
    got = [r["result"] for r in reports]
    model, ref_steps, ref_scale = reference()
    assert got[0]["dtypes"] == ["torch.float16"]  # the forward ran under CPU fp16 autocast
    assert got[0]["steps"] == got[1]["steps"] == ref_steps, (got[0]["steps"], ref_steps)
    skipped = [s for s in ref_steps if s[1]]
    assert [s[0] for s in skipped] == [3] and skipped[0][2] == INIT_SCALE  # only the blown-up window overflowed
    assert got[0]["scale"] == got[1]["scale"] == ref_scale == INIT_SCALE / 2
    for result in got:
        counters = result["counters"]
        assert counters["skipped_steps"] == counters["overflow_steps"] == 1
        assert result["scheduler_steps"] == counters["optimizer_steps"] - 1  # no LR step for the overflow
    # the step-keyed factor 2 starts after 3 real steps, i.e. at window 5, not 4
    assert [s[3] for s in got[0]["steps"]][:5] == [1, 1, 1, 1, 2]
    for rank in range(2):
        for mine, theirs in zip(params[rank], model.parameters()):
            torch.testing.assert_close(mine, theirs.detach(), rtol=2e-3, atol=2e-4, msg=f"rank {rank}")
    for a, b in zip(*params):
        assert torch.equal(a, b)  # DDP: identical on both ranks


FP16_RUN = """\
run: {{output_dir: {out}, seed: 0, epochs: 2, precision: fp16}}
task: {{target: "eval_tasks:regression", args: {{fp16_overflow_at: 3}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{nonfinite: raise}}
optimizer: {{name: sgd, lr: 0.05}}
lr_scheduler: {{name: linear}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def test_accum_sched_run_fp16_on_cpu(tmp_path):
    cfg = tmp_path / "fp16.yaml"
    cfg.write_text(FP16_RUN.format(out=tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg)], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "run"
    steps = [json.loads(line) for line in open(run / "metrics.jsonl")]
    summary = json.loads((run / "summary.json").read_text())
    # 96 samples / 2 ranks / 8 = 6 steps per epoch; rank 1's 3rd micro-batch overflows: step 3, at the initial scale
    assert [s["step"] for s in steps if s["skipped"]] == [3]
    assert steps[2]["loss_scale"] == INIT_SCALE and steps[3]["loss_scale"] == INIT_SCALE / 2
    assert steps[2]["lr"] == steps[3]["lr"]  # the LR waits for a real step
    assert summary["skipped_steps"] == summary["overflow_steps"] == 1 and summary["optimizer_steps"] == 12
    evals = [json.loads(line) for line in open(run / "eval.jsonl")]
    assert [e["epoch"] for e in evals] == [0, 1] and all(e["val_elements"] == 101 for e in evals)
