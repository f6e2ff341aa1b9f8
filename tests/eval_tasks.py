"""A user task with a validation set (``eval_tasks:regression``) for tests/launcher/train/test_eval.py and
tests/launcher/train/test_fp16_cpu.py.

A small MLP regression, optionally with dropout (training draws from the RNG), an odd-sized validation set (so
shards differ in length and no micro-batch size divides it), a metric, and a validation loss that also draws from
the RNG, as random augmentation or a DataLoader with workers would: evaluation must hand training the same RNG.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_data(samples: int, seed: int):
    """Samples of one function (the same w for training and validation data), drawn with ``seed``."""
    w = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=g) * 0.5
    y = torch.tanh(x @ w) + 0.05 * torch.randn(samples, 2, generator=g)
    return x, y


def make_model(dropout: float) -> nn.Module:
    layers = [nn.Linear(6, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, 2))


def per_sample_loss(model, x, y):
    return ((model(x) - y) ** 2).mean(-1)


def loss_fn(model, batch):
    x, y = batch
    return per_sample_loss(model, x, y).sum(), x.shape[0]


def val_loss_fn(model, batch):
    torch.rand(3)  # consumes the RNG: the evaluation must not change what training draws next
    return loss_fn(model, batch)


def metrics_fn(model, batch):
    """mae: mean absolute error per output value; sign_acc: share of outputs with the target's sign."""
    x, y = batch
    out = model(x)
    return {"mae": ((out - y).abs().sum(), out.numel()),
            "sign_acc": (((out > 0) == (y > 0)).sum(), out.numel())}


def regression(samples: int = 96, val_samples: int = 101, dropout: float = 0.0, with_val: bool = True,
               fp16_overflow_at: int = 0):
    """``fp16_overflow_at``: on rank 1, the N-th loss_fn call (1-based) returns its loss times 1e30, so the scaled
    backward overflows fp16 (tests/launcher/train/test_fp16_cpu.py)."""
    x, y = make_data(samples, 1)
    task = {"model": make_model(dropout), "dataset": TensorDataset(x, y), "loss_fn": loss_fn}
    if fp16_overflow_at:
        import os

        calls = [0]

        def overflowing(model, batch):
            calls[0] += 1
            loss, n = loss_fn(model, batch)
            if os.environ.get("RANK") == "1" and calls[0] == fp16_overflow_at:
                loss = loss * 1e30
            return loss, n

        task["loss_fn"] = overflowing
    if with_val:
        vx, vy = make_data(val_samples, 2)
        task.update(val_dataset=TensorDataset(vx, vy), val_loss_fn=val_loss_fn, metrics_fn=metrics_fn)
    return task


def plain_eval(state: dict, dropout: float = 0.0, val_samples: int = 101) -> dict:
    """The test's own numbers for a model state: plain means over the whole validation set, one batch, float64."""
    model = make_model(dropout)
    model.load_state_dict(state)
    model.eval()
    vx, vy = make_data(val_samples, 2)
    with torch.no_grad():
        out = model(vx).double()
        return {"val_loss": ((out - vy.double()) ** 2).mean(-1).mean().item(),
                "mae": (out - vy.double()).abs().mean().item(),
                "sign_acc": ((out > 0) == (vy > 0)).double().mean().item()}
