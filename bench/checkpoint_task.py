"""User task (``checkpoint_task:mlp``) of bench/checkpoint_cost.py: bench/workload.py's MLP (about 1M or 20M
parameters) on fixed synthetic regression data, so that `accum-sched run` trains exactly the model the other
benchmarks time."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from workload import D_IN, D_OUT, build_model  # noqa: E402


def mlp(size: str = "1M", samples: int = 1024):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(samples, D_IN, generator=g)
    y = torch.randn(samples, D_OUT, generator=g)

    def loss_fn(model, batch):
        inputs, targets = batch
        return ((model(inputs) - targets) ** 2).mean(-1).sum(), inputs.shape[0]

    return {"model": build_model(size), "dataset": TensorDataset(x, y), "loss_fn": loss_fn}
