"""Optimizers and LR schedulers by import path (launcher/train/optim.py), in one process: what they build, that training
with them through the engine equals plain torch, and the one-line errors naming the field (before launch where
possible, without torch for `check`). The 3-rank launcher run with torch.optim.RMSprop is in
tests/launcher/train/test_eval.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import paths
from launcher.config import validate
from launcher.errors import ConfigError
from launcher.train.optim import build_lr_scheduler, build_optimizer, check_config

ROOT = paths.ROOT
BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 4}}


def config(optimizer=None, lr_scheduler=None):
    raw = dict(BASE, optimizer=optimizer or {})
    if lr_scheduler is not None:
        raw["lr_scheduler"] = lr_scheduler
    return validate(raw)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.ln(self.fc(x))))


def batches(n=12):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def test_rmsprop_by_import_path_trains_like_plain_torch():
    from accum_sched import AccumulationEngine

    cfg = config({"name": "torch.optim:RMSprop", "lr": 0.01, "momentum": 0.3, "weight_decay": 0.05,
                  "no_decay": ["bias", "norm"], "args": {"alpha": 0.9, "centered": True}},
                 {"name": "torch.optim.lr_scheduler.CosineAnnealingLR", "args": {"eta_min": 0.001}})
    model = Net()
    opt = build_optimizer(cfg.optimizer, model)
    sched = build_lr_scheduler(cfg.lr_scheduler, opt, total_steps=4)
    assert type(opt) is torch.optim.RMSprop and sched.T_max == 4  # the run's length filled in
    # biases and every LayerNorm parameter (matched by its module's class name) go without weight decay
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4] and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.defaults["alpha"] == 0.9

    engine = AccumulationEngine(model, opt, 3, lr_scheduler=sched)
    engine.train_epoch(batches(), lambda m, b: (((m(b[0]) - b[1]) ** 2).sum(), len(b[0])), 0)

    ref = Net()
    decay = [ref.fc.weight, ref.out.weight]
    plain = [ref.fc.bias, ref.ln.weight, ref.ln.bias, ref.out.bias]
    ropt = torch.optim.RMSprop([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=0.01, momentum=0.3,
                               weight_decay=0.05, alpha=0.9, centered=True)
    rsched = torch.optim.lr_scheduler.CosineAnnealingLR(ropt, T_max=4, eta_min=0.001)
    data = batches()
    for start in range(0, len(data), 3):
        x = torch.cat([b[0] for b in data[start:start + 3]])
        y = torch.cat([b[1] for b in data[start:start + 3]])
        ropt.zero_grad()
        ((ref(x) - y) ** 2).sum(-1).mean().backward()
        ropt.step()
        rsched.step()
    for (name, mine), theirs in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=name)


def test_custom_optimizer_from_the_users_module(tmp_path, monkeypatch):
    (tmp_path / "my_optim.py").write_text(textwrap.dedent("""
        import torch

        class Signum(torch.optim.Optimizer):
            def __init__(self, params, lr=0.1, beta=0.0):
                super().__init__(params, {"lr": lr, "beta": beta})

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad.sign(), alpha=-group["lr"])
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = Net()
    before = model.fc.weight.detach().clone()
    opt = build_optimizer(config({"name": "my_optim:Signum", "lr": 0.5, "args": {"beta": 0.1}}).optimizer, model)
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    assert opt.defaults == {"lr": 0.5, "beta": 0.1}
    assert torch.allclose((before - model.fc.weight).abs(), torch.full_like(before, 0.5))


ERRORS = [  # (optimizer, lr_scheduler, the error line starts with)
    ({"name": "nosuchpkg.optim:Lion"}, None, "optimizer.name: cannot import 'nosuchpkg.optim:Lion'"),
    ({"name": "torch.optim.Nope"}, None, "optimizer.name: cannot import 'torch.optim.Nope': module 'torch.optim' has"),
    ({"name": "torch.nn.Linear"}, None, "optimizer.name: 'torch.nn.Linear' is not an optimizer"),
    ({"name": "torch.optim.RMSprop", "args": {"alpah": 0.9}}, None,
     "optimizer.args.alpah: torch.optim.RMSprop takes no keyword 'alpah'"),
    ({"name": "torch.optim.Adagrad", "momentum": 0.9}, None,
     "optimizer.momentum: torch.optim.Adagrad takes no keyword"),
    ({}, {"name": "torch.optim.lr_scheduler.ReduceLROnPlateau"}, "lr_scheduler.name: torch.optim.lr_scheduler."
     "ReduceLROnPlateau.step needs metrics"),
    ({}, {"name": "torch.optim.lr_scheduler.StepLR", "args": {"step_sise": 3}},
     "lr_scheduler.args.step_sise: torch.optim.lr_scheduler.StepLR takes no keyword"),
    ({}, {"name": "torch.optim.lr_scheduler.StepLR"}, "lr_scheduler.args: torch.optim.lr_scheduler.StepLR rejected"),
]


@pytest.mark.parametrize("optimizer,lr_scheduler,expected", ERRORS)
def test_errors_name_the_field(optimizer, lr_scheduler, expected):
    cfg = config(optimizer, lr_scheduler)
    with pytest.raises(ConfigError) as err:
        opt = build_optimizer(cfg.optimizer, Net())
        build_lr_scheduler(cfg.lr_scheduler, opt, 10)
    assert err.value.line().startswith(expected), err.value.line()
    if not expected.startswith("lr_scheduler.args: "):  # constructing the class is the only way to see that one
        with pytest.raises(ConfigError):
            check_config(cfg)  # what `accum-sched run` checks before launching


def test_check_finds_a_missing_package_without_torch(tmp_path):
    body = textwrap.dedent("""\
        task: {target: builtin:regression}
        data: {micro_batch_size: 4}
        optimizer: {name: %s}
    """)
    (tmp_path / "good.yaml").write_text(body % "torch.optim.RMSprop")
    (tmp_path / "bad.yaml").write_text(body % "nosuchpkg.optim:Lion")
    code = ("import sys; from launcher.cli import main; good = main(['check', 'good.yaml']); "
            "bad = main(['check', 'bad.yaml']); assert 'torch' not in sys.modules, 'torch imported'; "
            "print('codes', good, bad)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "codes 0 2" in proc.stdout, proc.stdout + proc.stderr
    assert "error: optimizer.name: cannot import 'nosuchpkg.optim:Lion': no module named 'nosuchpkg'" in proc.stderr
