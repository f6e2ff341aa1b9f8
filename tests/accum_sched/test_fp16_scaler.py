"""fp16 with the GradScaler's verdict folded into the window's one read: the engine drives unscale_ / step / update
itself (found-inf and the scale are read with the window's numbers, not by GradScaler.step and get_scale()), so the
scale's update rule must stay the scaler's own.

One process, CPU float16 autocast, a scaler with a short growth interval (the scale grows as well as backs off),
windows blown up to overflow (two in a row, one alone, one inside a partial window). A plain-torch loop with its own
GradScaler (``scaler.step`` / ``scaler.update``) over the same windows is the reference: the per-step loss scale and
skipped flags are identical, the final scale and growth tracker too, the parameters equal at fp16 rounding.
"""
from __future__ import annotations

import torch
from torch import nn

MICRO, BATCHES, FACTOR = 4, 23, 2  # 12 windows, the last one partial (1 micro-batch)
BLOW_UP = {4, 6, 7, 14, 22}  # micro-batches whose loss is multiplied by 1e30: windows 2, 3, 7 and the last
SCALER = {"init_scale": 2.0 ** 10, "growth_interval": 2}


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 2, generator=g)) for _ in range(BATCHES)]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _loss_sum(model, x, y, index):
    loss = ((model(x) - y) ** 2).mean(-1).sum()
    return loss * 1e30 if index in BLOW_UP else loss


def _engine_run():
    from accum_sched import AccumulationEngine

    model, opt = _model_and_optimizer()
    engine = AccumulationEngine(model, opt, FACTOR, precision="fp16", nonfinite="raise", micro_batch_size=MICRO)
    engine.backend.scaler = torch.amp.GradScaler("cpu", **SCALER)
    steps = []
    engine.on_step(lambda info: steps.append((info.loss_scale, info.skipped)))
    for index, (x, y) in enumerate(engine.micro_batches(_batches(), 0)):
        with engine.autocast():
            loss = _loss_sum(model, x, y, index)
        engine.backward(loss, MICRO)
    return model, steps, engine


def _reference_run():
    """The usual GradScaler loop: every window's micro-batches back-propagated at 1/(full window's elements)."""
    model, opt = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    data, steps = _batches(), []
    for start in range(0, BATCHES, FACTOR):
        opt.zero_grad()
        for index in range(start, min(start + FACTOR, BATCHES)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss_sum(model, *data[index], index) / (MICRO * FACTOR)
            scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        steps.append((before, scaler.get_scale() < before))
    return model, steps, scaler


def test_scale_sequence_and_skips_equal_the_grad_scalers_own_over_forced_overflows():
    model, steps, engine = _engine_run()
    ref_model, ref_steps, ref_scaler = _reference_run()
    assert steps == ref_steps
    scales = [s for s, _ in steps]
    # the run exercises both halves of the rule: a backoff (x0.5) and a growth (x2 after growth_interval steps)
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert [skipped for _, skipped in steps].count(True) == 4 == engine.overflow_steps == engine.skipped_steps
    assert engine.backend.scaler.get_scale() == ref_scaler.get_scale()
    assert engine.backend.scaler._get_growth_tracker() == ref_scaler._get_growth_tracker()
    for got, want in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-5), (got - want).abs().max()
