"""User tasks (``faulty_tasks:regression``) for the checkpoint tests: a small regression that can fail once.

The fault is chosen by environment variables, not task.args, because task.args are part of the config hash that
a resume checks:

  FAULT_MODE    kill (SIGKILL itself, like the OOM killer) or raise (an exception: the job fails)
  FAULT_RANK    the rank that fails (RANK of torchrun)
  FAULT_AT      the N-th loss_fn call of that process (1-based), i.e. its N-th micro-batch, mid-window if you like
  FAULT_MARKER  a file created just before the fault; while it exists the fault never fires again, so a restarted
                or resumed group trains on
"""
from __future__ import annotations

import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset


def _maybe_fail(calls: int) -> None:
    mode = os.environ.get("FAULT_MODE")
    if not mode or os.environ.get("RANK", "0") != os.environ.get("FAULT_RANK", "0"):
        return
    marker = os.environ["FAULT_MARKER"]
    if calls != int(os.environ["FAULT_AT"]) or os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write(f"{mode} at micro-batch {calls}\n")
        f.flush()
        os.fsync(f.fileno())
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"faulty_tasks: injected failure at micro-batch {calls}")


def regression(samples: int = 256, in_dim: int = 8, hidden: int = 32, out_dim: int = 2, dropout: float = 0.0,
               nan_index: int | None = None, data_seed: int = 7):
    """y = tanh(x W); an MLP with optional dropout (so the RNG matters on resume) and optionally one sample whose
    target is NaN (its window's step is skipped as non-finite in every epoch)."""
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(samples, in_dim, generator=g)
    y = torch.tanh(x @ torch.randn(in_dim, out_dim, generator=g))
    if nan_index is not None:
        y[nan_index] = float("nan")
    model = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, out_dim))
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        _maybe_fail(calls[0])
        inputs, targets = batch
        per_sample = ((model(inputs) - targets) ** 2).mean(-1)
        return per_sample.sum(), inputs.shape[0]

    return {"model": model, "dataset": TensorDataset(x, y), "loss_fn": loss_fn}
