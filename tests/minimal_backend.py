"""A back end written against accum_sched.backends.Backend alone (tests/accum_sched/test_backend_seam.py registers it).

One process, gradients in ``.grad``: what docs/backends.md's "adding a back end" asks for, and one option of its own,
``lr_multiplier``, which multiplies the window's gradient before the optimizer steps (for SGD without weight decay:
an LR x ``lr_multiplier``), so a test can check exactly that the option reached the back end
(tests/launcher/backends/test_added_backend_run.py trains it through `accum-sched run` with
tests/minimal_launcher_backend.py).
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

    def __init__(self, model, optimizer, lr_scheduler=None, *, precision: str = "fp32", lr_multiplier: float = 1.0):
        if precision != "fp32":
            raise ValueError(f"precision={precision!r}: the minimal back end trains in fp32 only")
        if not lr_multiplier > 0:
            raise ValueError(f"lr_multiplier={lr_multiplier!r} must be > 0")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.lr_multiplier = float(lr_multiplier)

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
        if lr_scale != 1.0:  # LR coupling / AdaScale would need an optimizer step at another LR: not supported here
            raise ValueError(f"lr_scale={lr_scale}: the minimal back end steps at the optimizer's own LR only")
        if not skip:
            # after the clipping factor: the option scales the step, not what clipping measures
            scale_gradients(self._grads(), gradient_scale(coef, max_norm, norm) * self.lr_multiplier)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
