"""accumulation.co_scale (issue 27.1): LR, Adam's beta2 and weight decay follow the effective batch at every factor
change, on every rank, against a plain-torch large-batch reference that sets the same values itself.

The reference computes each window's rule from r = factor / first factor with its own arithmetic (not the product's
functions): lr x r or x sqrt(r), beta2 ** r, weight decay x r / (LR multiplier). A rule not applied, applied to the
wrong window, applied twice, or left in the param groups after the step (which the next window and the LR scheduler
would see) moves the weights well beyond the tolerance.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import cases
from distributed import spawn

CASE = cases.Case("co-scale", {0: 1, 1: 2, 3: 4}, epochs=5, samples=(37, 39), lr=0.02)
BASE = {"lr": 0.02, "betas": (0.9, 0.95), "weight_decay": 0.1}


def make_optimizer(name: str, model: torch.nn.Module):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=BASE["lr"], betas=BASE["betas"],
                                 weight_decay=BASE["weight_decay"])
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=BASE["lr"], betas=BASE["betas"], weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=BASE["lr"], momentum=0.9, weight_decay=0.01)


RUNS = {  # name: (optimizer, co_scale)
    "adamw/auto-half_life-tau": ("adamw", {"lr": "auto", "beta2": "half_life", "weight_decay": "tau"}),
    "adamw/linear-tau": ("adamw", {"lr": "linear", "weight_decay": "tau"}),
    "adam/none-half_life": ("adam", {"beta2": "half_life"}),
    "sgd/auto-tau": ("sgd", {"lr": "auto", "weight_decay": "tau"}),
}


def expected(name: str, factor: int, first: int = 1) -> dict:
    """The values a window of ``factor`` must step with, by the rules' definitions."""
    optimizer, rules = RUNS[name]
    r = factor / first
    lr_rule = rules.get("lr", "none")
    if lr_rule == "auto":
        lr_rule = "sqrt" if optimizer in ("adam", "adamw") else "linear"
    m = {"none": 1.0, "linear": r, "sqrt": math.sqrt(r)}[lr_rule]
    base_wd = BASE["weight_decay"] if optimizer == "adamw" else 0.01
    out = {"lr": BASE["lr"] * m,
           "weight_decay": base_wd * (r / m if rules.get("weight_decay") == "tau" else 1.0)}
    if optimizer != "sgd":
        out["beta2"] = BASE["betas"][1] ** (r if rules.get("beta2") == "half_life" else 1.0)
    return out


def reference(name: str, world: int) -> torch.nn.Module:
    """One large batch per window of every rank's micro-batches; the window's values set by hand around its step."""
    from accum_sched import AccumulationSchedule

    schedule = AccumulationSchedule(CASE.schedule)
    model = cases.make_model(CASE)
    opt = make_optimizer(RUNS[name][0], model)
    for epoch in range(CASE.epochs):
        per_rank = [cases.rank_batches(CASE, r, epoch) for r in range(world)]
        n, factor = min(len(b) for b in per_rank), schedule.factor(epoch)
        want = expected(name, factor)
        for start in range(0, n, factor):
            window = [per_rank[r][i] for r in range(world) for i in range(start, min(start + factor, n))]
            big = (torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]))
            losses, _ = cases.element_losses(model, big, CASE.kind)
            opt.zero_grad()
            losses.mean().backward()
            saved = [dict(g) for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"], g["weight_decay"] = want["lr"], want["weight_decay"]
                if "beta2" in want:
                    g["betas"] = (g["betas"][0], want["beta2"])
            opt.step()
            for g, old in zip(opt.param_groups, saved):
                g.update({k: old[k] for k in ("lr", "betas", "weight_decay") if k in old})
    return model


def _worker(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    results = {}
    for name, (optimizer, rules) in RUNS.items():
        model = cases.make_model(CASE)
        opt = make_optimizer(optimizer, model)
        engine = AccumulationEngine(DDP(model), opt, CASE.schedule, co_scale=rules, micro_batch_size=CASE.micro)
        steps = []
        engine.on_step(lambda info, steps=steps: steps.append(
            {"factor": info.factor, "lr": info.lr, "beta2": info.beta2, "weight_decay": info.weight_decay}))
        for epoch in range(CASE.epochs):
            engine.train_epoch(cases.rank_batches(CASE, rank, epoch), cases.loss_fn_for(CASE.kind), epoch)
        # the groups hold their base values again after every step
        groups = [{k: g[k] for k in ("lr", "betas", "weight_decay") if k in g} for g in opt.param_groups]
        results[name] = {"params": cases.params(model), "steps": steps, "groups": groups}
    torch.save(results, os.path.join(out, f"co-scale-{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("co_scale")
    spawn(_worker, 2, str(out), deadline_s=300)
    return [torch.load(out / f"co-scale-{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.parametrize("name", list(RUNS))
def test_co_scaled_run_equals_the_reference_on_every_rank(ranks, name):
    want = cases.params(reference(name, 2))
    for rank, results in enumerate(ranks):
        run = results[name]
        for got, ref in zip(run["params"], want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
        factors = {s["factor"] for s in run["steps"]}
        assert factors == {1, 2, 4}, factors  # every factor change happened
        for step in run["steps"]:
            values = expected(name, step["factor"])
            assert step["lr"] == pytest.approx(values["lr"]), (name, step)
            assert step["weight_decay"] == pytest.approx(values["weight_decay"]), (name, step)
            assert step["beta2"] == (pytest.approx(values["beta2"]) if "beta2" in values else None), (name, step)
        base_wd = BASE["weight_decay"] if RUNS[name][0] == "adamw" else 0.01
        assert all(g["lr"] == BASE["lr"] and g["weight_decay"] == base_wd for g in run["groups"]), run["groups"]


@pytest.mark.parametrize("rules,optimizer,message", [
    ({"beta2": "half_life"}, "sgd", "has no betas"),
    ({"lr": "auto"}, "rmsprop", "neither Adam-family"),
    ({"lr": "cubic"}, "adamw", "co_scale.lr='cubic' is not one of"),
    ({"beta3": "half_life"}, "adamw", "unknown key(s) beta3"),
])
def test_rules_that_cannot_apply_are_refused(rules, optimizer, message):
    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    opt = (torch.optim.RMSprop(model.parameters(), lr=0.01) if optimizer == "rmsprop"
           else make_optimizer(optimizer, model))
    with pytest.raises(ValueError, match=None) as error:
        AccumulationEngine(model, opt, CASE.schedule, co_scale=rules)
    assert message in str(error.value), str(error.value)


def test_lr_coupling_is_the_lr_rule_under_another_name():
    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    with pytest.raises(ValueError, match="disagree"):
        AccumulationEngine(model, make_optimizer("adamw", model), CASE.schedule, lr_coupling="linear",
                           co_scale={"lr": "sqrt"})
    engine = AccumulationEngine(model, make_optimizer("adamw", model), CASE.schedule, lr_coupling="sqrt",
                                co_scale={"lr": "sqrt", "beta2": "half_life"})
    assert engine.optimizer_rules.rules == {"lr": "sqrt", "beta2": "half_life", "weight_decay": "none"}
