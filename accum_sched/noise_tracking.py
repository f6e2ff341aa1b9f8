"""NoiseTracking: the engine's part that measures the gradient noise scale of every window and, with ``adaptive``,
lets the :class:`~accum_sched.adaptive.AdaptiveFactor` choose the next window's factor from it.

The engine calls it at three points: after each backward (the probe's per-micro-batch sums), at the window's end
(one all-reduce of four numbers, :meth:`finish_window`) and after the step (:meth:`after_step`, where the controller
decides from all-reduced numbers only, so every rank decides alike). Its EMAs and the controller's decisions are
saved in the engine's state_dict, so a resume repeats them bit for bit.
"""
from __future__ import annotations

import torch

from accum_sched.adaptive import AdaptiveFactor
from accum_sched.noise_scale import WindowNoise


class NoiseTracking:
    """Args:
        backend: the engine's back end (its probe reads DDP buckets or whole local gradients; refused elsewhere).
        adaptive: an AdaptiveFactor (or a mapping of its arguments), or None to measure only.
        normalize, precision: the engine's (the estimator needs per-element means, and no fp16 loss scaling).
    """

    def __init__(self, backend, adaptive=None, *, normalize: str = "elements", precision: str = "fp32"):
        self.adaptive = None if adaptive is None else AdaptiveFactor.build(adaptive)
        if normalize != "elements":
            raise ValueError("noise_scale needs normalize='elements' (the estimator works on per-element means)")
        if backend.capabilities.noise_scale is None:  # its probes read DDP buckets or whole local gradients
            raise ValueError(f"noise_scale / adaptive are not measured with {backend.name} yet; use DDP or "
                             f"DeepSpeed ZeRO-0")
        if precision == "fp16":
            raise ValueError("noise_scale is not measured under fp16 (loss-scaled local gradients); use bf16 or fp32")
        if self.adaptive is not None and backend.world_size == 1 and self.adaptive.min_factor < 2:
            raise ValueError("adaptive in one process needs min_factor >= 2: the noise scale is estimated from the "
                             "micro-batches of a window, and a window of one micro-batch has a single batch size")
        self.noise = WindowNoise(backend, self.adaptive.ema if self.adaptive is not None else 0.95)

    @property
    def reason(self) -> str | None:
        """Why the current window has its factor (the adaptive controller's last decision); None without one."""
        return None if self.adaptive is None else self.adaptive.reason

    def after_backward(self, n_elements, loss_multiplier: float, boundary: bool) -> None:
        self.noise.after_backward(torch.as_tensor(n_elements, dtype=torch.float64), loss_multiplier, boundary)

    def finish_window(self, grad_norm: float, coef: float, elements: float, skip: bool) -> dict:
        """The window's gns_* fields and noise_scale (one all-reduce); a skipped step stays out of the EMAs."""
        return self.noise.finish_window(grad_norm * grad_norm, coef, elements, update=not skip)

    def after_step(self, step: int, noise: dict, elements: float, micro_batches: int) -> None:
        """The controller (if any) sees the finished window and may choose the next factor."""
        if self.adaptive is not None:
            self.adaptive.after_window(step, noise["noise_scale"], elements, micro_batches)

    def state_dict(self) -> dict:
        out = {"noise_scale": self.noise.estimator.state_dict()}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if "noise_scale" in state:
            self.noise.estimator.load_state_dict(state["noise_scale"])
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])


__all__ = ["NoiseTracking"]
