"""User tasks for tests/launcher/train/test_scale_costs.py (``scale_tasks:slow_regression``): a regression whose
dataset records every sample it loads and whose micro-batches can be made slow. Set by environment variables, not
task.args (task.args are in the config hash a resume checks):

  LOADS_DIR    each process appends the indices it loads to LOADS_DIR/loads-rank<RANK>.txt
  SLOW_S       seconds every loss_fn call sleeps (a long window at a large factor)
  STARTED      a file created at the first loss_fn call (training has begun; planning is over)
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset


class CountingDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        where = os.environ.get("LOADS_DIR")
        if where:
            with open(os.path.join(where, f"loads-rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
                f.write(f"{int(i)}\n")
        return self.x[i], self.y[i]


def loads(where: str, rank: int) -> list[int]:
    path = os.path.join(where, f"loads-rank{rank}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f if line.strip()]


def slow_regression(samples: int = 64, in_dim: int = 8, hidden: int = 16, out_dim: int = 2):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(samples, in_dim, generator=g)
    y = torch.tanh(x @ torch.randn(in_dim, out_dim, generator=g))
    model = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, out_dim))

    def loss_fn(model, batch):
        started = os.environ.get("STARTED")
        if started and not os.path.exists(started):
            open(started, "w").close()
        time.sleep(float(os.environ.get("SLOW_S", "0")))
        inputs, targets = batch
        per_sample = ((model(inputs) - targets) ** 2).mean(-1)
        return per_sample.sum(), inputs.shape[0]

    return {"model": model, "dataset": CountingDataset(x, y), "loss_fn": loss_fn,
            "length_fn": lambda sample: 1}  # one element per sample: tokens-keyed planning counts samples
