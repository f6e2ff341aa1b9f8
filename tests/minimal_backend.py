"""A back end written against accum_sched.backends.Backend alone (tests/accum_sched/test_backend_seam.py registers it).

One process, gradients in ``.grad``: what docs/backends.md's "adding a back end" asks for, and nothing more.
"""
from __future__ import annotations

import torch

from accum_sched.backends import Backend, Capabilities
from accum_sched.step_rules import NO_CONTEXT, gradient_scale, scale_gradients, squared_norm


class Marked(torch.nn.Linear):
    """The model type this back end claims."""


def claims(model) -> bool:
    return isinstance(model, Marked)


class MinimalBackend(Backend):
    name = "minimal"
    capabilities = Capabilities(stop_mid_window=False, prescale=True, fp16="refused", noise_scale=None)

    def __init__(self, model, optimizer, lr_scheduler=None, options=None):
        self.model, self.optimizer = model, optimizer

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def sync_context(self, boundary: bool):
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        self._stats = stats  # one process: nothing to sum

    def window_totals(self, want_norm: bool):
        return self._stats, squared_norm(self._grads()) if want_norm else None

    def step(self, coef, max_norm, norm, skip, lr_scale=1.0) -> None:
        if not skip:
            scale_gradients(self._grads(), gradient_scale(coef, max_norm, norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
