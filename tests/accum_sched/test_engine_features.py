"""Engine features under DDP on 2 real gloo processes: non-finite steps, bf16 autocast, the LR scheduler, resume
from a mid-epoch state_dict, refused set-ups, short epochs. One launch runs every scenario; each rank records what
it saw and the test process compares it with plain-torch references computed here.
"""
from __future__ import annotations

import io
import json
import os

import pytest
import torch

import cases
from accum_sched import AccumulationSchedule
from distributed import attempt, spawn

FEAT = cases.Case("features", {0: 2, 1: 3}, epochs=2, samples=(40, 38))  # 10 micro-batches a rank, short last one
RESUME = cases.Case("resume", {0: 2, 1: 3}, epochs=3, samples=(40, 38), optimizer="adamw")
SHORT = cases.Case("short", {0: 8}, epochs=2, samples=(12, 11))  # 3 micro-batches < factor 8
NAN_AT = (1, 4)  # (epoch, micro-batch) where rank 1's loss turns NaN: the middle of window 1 of epoch 1 (factor 3)
NAN_STEP = 5 + 2  # 5 steps in epoch 0 (10 micro-batches / 2), then window 1 of epoch 1 is step 7
STOP_AFTER = 6  # resume scenario: stop requested after step 6, agreed (so taken) after step 7, mid-epoch 1


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def _ddp_engine(case, schedule=None, scheduler=False, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(case)
    optimizer = cases.make_optimizer(case, model)
    sched = make_scheduler(optimizer) if scheduler else None
    engine = AccumulationEngine(DDP(model), optimizer, case.schedule if schedule is None else schedule,
                                lr_scheduler=sched, **kwargs)
    return model, optimizer, sched, engine


def _nan_loss_fn(rank: int):
    """The regression loss, except that rank 1 reports NaN at micro-batch NAN_AT."""
    base = cases.loss_fn_for("regression")
    seen = {}

    def loss_fn(model, batch):
        epoch = seen.setdefault("epoch", 0)
        index = seen.setdefault(epoch, 0)
        seen[epoch] = index + 1
        loss_sum, n = base(model, batch)
        if rank == 1 and (epoch, index) == NAN_AT:
            loss_sum = loss_sum * float("nan")
        return loss_sum, n

    return loss_fn, seen


def _feature_checks(rank: int, world: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    report = {}
    regression = cases.loss_fn_for("regression")

    def save(name, model):
        torch.save(cases.params(model), os.path.join(out_dir, f"{name}-{rank}.pt"))

    def nonfinite(mode):
        model, _, _, engine = _ddp_engine(FEAT, nonfinite=mode)
        skipped = []
        engine.on_step(lambda info: skipped.append(info.step) if info.skipped else None)
        loss_fn, seen = _nan_loss_fn(rank)
        for epoch in range(FEAT.epochs):
            seen["epoch"] = epoch
            engine.train_epoch(cases.rank_batches(FEAT, rank, epoch), loss_fn, epoch)
        save(f"nonfinite-{mode}", model)
        return {"skipped": skipped, "counters": engine.counters()}

    report["skip"] = attempt(lambda: nonfinite("skip"))
    report["raise"] = attempt(lambda: nonfinite("raise"))

    def bf16():
        model, _, _, engine = _ddp_engine(FEAT, precision="bf16")
        dtypes = set()

        def loss_fn(m, batch):
            x, y = batch
            out = m(x)
            dtypes.add(str(out.dtype))  # proves autocast was on for the forward
            return ((out.float() - y) ** 2).sum(), x.shape[0]

        for epoch in range(FEAT.epochs):
            for batch in engine.micro_batches(cases.rank_batches(FEAT, rank, epoch), epoch):
                with engine.autocast():
                    loss_sum, n = loss_fn(engine.model, batch)
                engine.backward(loss_sum, n)
        save("bf16", model)
        return sorted(dtypes)

    report["bf16"] = attempt(bf16)

    def scheduled_lr():
        model, _, sched, engine = _ddp_engine(FEAT, scheduler=True)
        lrs = []
        engine.on_step(lambda info: lrs.append(info.lr))
        for epoch in range(FEAT.epochs):
            engine.train_epoch(cases.rank_batches(FEAT, rank, epoch), regression, epoch)
        save("lr", model)
        return {"lrs": lrs, "scheduler_steps": sched.last_epoch, "steps": engine.optimizer_steps}

    report["lr"] = attempt(scheduled_lr)

    def prescaled():
        # micro_batch_size known: losses are pre-divided by a full window's count, the boundary scales only when
        # the window was not full (rank 1's short last micro-batch closes each epoch's last window)
        model, _, _, engine = _ddp_engine(FEAT, micro_batch_size=FEAT.micro)
        coefs = []
        step = engine.backend.step

        def recording_step(coef, *args, **kwargs):
            coefs.append(coef)
            return step(coef, *args, **kwargs)

        engine.backend.step = recording_step
        for epoch in range(FEAT.epochs):
            engine.train_epoch(cases.rank_batches(FEAT, rank, epoch), regression, epoch)
        save("prescaled", model)
        return coefs

    report["prescaled"] = attempt(prescaled)

    def resume():
        # uninterrupted
        model, _, _, engine = _ddp_engine(RESUME, scheduler=True)
        for epoch in range(RESUME.epochs):
            engine.train_epoch(cases.rank_batches(RESUME, rank, epoch), regression, epoch)
        save("resume-straight", model)
        straight = engine.counters()
        # interrupted mid-epoch, saved through torch.save, continued by fresh objects
        model, optimizer, sched, engine = _ddp_engine(RESUME, scheduler=True)
        engine.on_step(lambda info: engine.request_stop() if info.step == STOP_AFTER else None)
        for epoch in range(RESUME.epochs):
            engine.train_epoch(cases.rank_batches(RESUME, rank, epoch), regression, epoch)
            if engine.should_stop:
                break
        buffer = io.BytesIO()
        torch.save({"engine": engine.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": sched.state_dict()}, buffer)
        stopped_at = [engine.epoch_index, engine.micro_in_epoch]
        del model, optimizer, sched, engine
        buffer.seek(0)
        state = torch.load(buffer)
        model = cases.make_model(RESUME)
        model.load_state_dict(state["model"])
        optimizer = cases.make_optimizer(RESUME, model)
        optimizer.load_state_dict(state["optimizer"])
        sched = make_scheduler(optimizer)
        sched.load_state_dict(state["scheduler"])
        engine = AccumulationEngine(DDP(model), optimizer, RESUME.schedule, lr_scheduler=sched)
        engine.load_state_dict(state["engine"])
        for epoch in range(engine.epoch_index, RESUME.epochs):
            engine.train_epoch(cases.rank_batches(RESUME, rank, epoch), regression, epoch)
        save("resume-continued", model)
        return {"straight": straight, "continued": engine.counters(), "stopped_at": stopped_at}

    report["resume"] = attempt(resume)

    def static_graph():
        model = cases.make_model(FEAT)
        AccumulationEngine(DDP(model, static_graph=True), cases.make_optimizer(FEAT, model), 2)

    report["static_graph"] = attempt(static_graph)

    def unwrapped():
        model = cases.make_model(FEAT)
        AccumulationEngine(model, cases.make_optimizer(FEAT, model), 2)

    report["unwrapped"] = attempt(unwrapped)

    def short_epoch():
        model, _, _, engine = _ddp_engine(SHORT)
        for epoch in range(SHORT.epochs):
            engine.train_epoch(cases.rank_batches(SHORT, rank, epoch), regression, epoch)
        save("short", model)
        return engine.counters()

    report["short"] = attempt(short_epoch)

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def reference(case, world, skip=(), scheduler=False):
    """Plain torch, one process: one large batch per window; windows in ``skip`` ((epoch, index)) do not step.

    Returns the model and the learning rate each window's step used.
    """
    schedule = AccumulationSchedule(case.schedule)
    model = cases.make_model(case)
    optimizer = cases.make_optimizer(case, model)
    sched = make_scheduler(optimizer) if scheduler else None
    lrs = []
    for epoch in range(case.epochs):
        per_rank = [cases.rank_batches(case, r, epoch) for r in range(world)]
        n = min(len(b) for b in per_rank)
        factor = schedule.factor(epoch)
        for index, start in enumerate(range(0, n, factor)):
            window = [per_rank[r][i] for r in range(world) for i in range(start, min(start + factor, n))]
            x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
            loss = ((model(x) - y) ** 2).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            lrs.append(optimizer.param_groups[0]["lr"])
            if (epoch, index) not in skip:
                optimizer.step()
            if sched is not None:
                sched.step()  # once per window, i.e. per optimizer step
    return model, lrs


def assert_params(got, ref_model, atol=1e-6):
    for g, r in zip(got, cases.params(ref_model)):
        torch.testing.assert_close(g, r, atol=atol, rtol=1e-5)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    spawn(_feature_checks, 2, str(out), deadline_s=240)  # a hang fails in 4 minutes, not after gloo's 30
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _load(out, name, rank):
    return torch.load(out / f"{name}-{rank}.pt")


def test_nonfinite_skip_skips_the_same_step_on_every_rank(reports):
    out, per_rank = reports
    ref, _ = reference(FEAT, 2, skip={(1, 1)})
    plain, _ = reference(FEAT, 2)
    for rank, report in enumerate(per_rank):
        seen = report["skip"]
        assert seen["error"] is None, seen["error"]
        assert seen["result"]["skipped"] == [NAN_STEP], seen["result"]
        assert seen["result"]["counters"]["skipped_steps"] == 1
        assert seen["result"]["counters"]["optimizer_steps"] == 5 + 4
        assert_params(_load(out, "nonfinite-skip", rank), ref)
    gap = max((a - b).abs().max().item() for a, b in zip(cases.params(ref), cases.params(plain)))
    assert gap > 1e-3  # skipping the window matters, so the comparison above can fail


def test_nonfinite_raise_raises_on_every_rank(reports):
    _, per_rank = reports
    for report in per_rank:
        error = report["raise"]["error"]
        assert error is not None and error[0] == "FloatingPointError", report["raise"]
        assert f"step {NAN_STEP}" in error[1] and "nonfinite='skip'" in error[1], error


def test_bf16_autocast_on_cpu_stays_close_to_fp32(reports):
    out, per_rank = reports
    ref, _ = reference(FEAT, 2)
    start = cases.params(cases.make_model(FEAT))
    for rank, report in enumerate(per_rank):
        assert report["bf16"]["error"] is None, report["bf16"]["error"]
        assert report["bf16"]["result"] == ["torch.bfloat16"]
        got = _load(out, "bf16", rank)
        assert_params(got, ref, atol=3e-2)
        moved = max((g - s).abs().max().item() for g, s in zip(got, start))
        off = max((g - r).abs().max().item() for g, r in zip(got, cases.params(ref)))
        assert off < 0.1 * moved, (off, moved)  # closer to fp32 than to where training started


def test_lr_scheduler_steps_once_per_optimizer_step(reports):
    out, per_rank = reports
    ref, ref_lrs = reference(FEAT, 2, scheduler=True)
    steps = AccumulationSchedule(FEAT.schedule).optimizer_steps(10, FEAT.epochs)
    for rank, report in enumerate(per_rank):
        seen = report["lr"]
        assert seen["error"] is None, seen["error"]
        assert seen["result"]["scheduler_steps"] == seen["result"]["steps"] == steps == len(ref_lrs)
        assert seen["result"]["lrs"] == pytest.approx(ref_lrs, rel=1e-12)
        assert len(set(ref_lrs)) > 2  # the LR did change over the run
        assert_params(_load(out, "lr", rank), ref)


def test_known_micro_batch_size_skips_the_scaling_pass_and_stays_exact(reports):
    out, per_rank = reports
    ref, _ = reference(FEAT, 2)
    for rank, report in enumerate(per_rank):
        seen = report["prescaled"]
        assert seen["error"] is None, seen["error"]
        coefs = seen["result"]
        last_of_epoch = {4, 8}  # 5 windows of 2, then 4 windows of 3 and 1: the windows holding the short batch
        assert [i for i, c in enumerate(coefs) if c != 1.0] == sorted(last_of_epoch), coefs
        assert_params(_load(out, "prescaled", rank), ref)


def test_resume_from_mid_epoch_state_dict_is_bitwise_equal(reports):
    out, per_rank = reports
    for rank, report in enumerate(per_rank):
        seen = report["resume"]
        assert seen["error"] is None, seen["error"]
        assert seen["result"]["stopped_at"] == [1, 2 * 3], seen["result"]  # epoch 1, after 2 windows of 3
        straight, continued = seen["result"]["straight"], seen["result"]["continued"]
        assert straight == continued, (straight, continued)
        for a, b in zip(_load(out, "resume-straight", rank), _load(out, "resume-continued", rank)):
            assert torch.equal(a, b), (a - b).abs().max()
    ref, _ = reference(RESUME, 2, scheduler=True)
    for rank in range(len(per_rank)):
        assert_params(_load(out, "resume-continued", rank), ref, atol=1e-5)


def test_static_graph_and_unwrapped_model_are_refused(reports):
    _, per_rank = reports
    for report in per_rank:
        error = report["static_graph"]["error"]
        assert error is not None and error[0] == "ValueError" and "static_graph" in error[1], error
        error = report["unwrapped"]["error"]
        assert error is not None and error[0] == "ValueError", error
        assert "DistributedDataParallel" in error[1] and "2 ranks" in error[1], error


def test_epoch_shorter_than_factor_steps_once_and_warns(reports):
    out, per_rank = reports
    ref, lrs = reference(SHORT, 2)
    assert len(lrs) == SHORT.epochs
    for rank, report in enumerate(per_rank):
        seen = report["short"]
        assert seen["error"] is None, seen["error"]
        assert seen["result"]["optimizer_steps"] == SHORT.epochs and seen["result"]["micro_batches"] == 3 * 2
        assert_params(_load(out, "short", rank), ref)
    assert sum("fewer than the factor 8" in w for w in per_rank[0]["short"]["warnings"]) == SHORT.epochs


def test_next_micro_batch_without_backward_raises():
    """Single process: no collective involved, so no launch needed."""
    from accum_sched import AccumulationEngine

    model = cases.make_model(FEAT)
    engine = AccumulationEngine(model, cases.make_optimizer(FEAT, model), 2)
    with pytest.raises(RuntimeError, match="engine.backward"):
        engine.backward(torch.zeros((), requires_grad=True), 1)  # no micro-batch handed out yet
    batches = engine.micro_batches(cases.rank_batches(FEAT, 0, 0), 0)
    x, y = next(batches)
    with pytest.raises(RuntimeError, match=r"call engine.backward\(loss_sum, n_elements\) for every micro-batch"):
        next(batches)
