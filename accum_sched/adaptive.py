"""AdaptiveFactor: an accumulation factor that follows the measured gradient noise scale.

Instead of a schedule, the engine asks this object for the factor of each window (``factor_for``, as it asks a
schedule) and feeds it every window's all-reduced statistics (``after_window``). Every ``every_n_steps`` optimizer
steps it decides the factor of the following windows:

* the target is the smoothed noise scale B_noise (elements, see :mod:`accum_sched.noise_scale`); a factor f gives
  windows of about f x ``elements_per_factor`` elements, where ``elements_per_factor`` is measured over the steps
  since the last decision (window elements / window micro-batches, all ranks; = micro x world for one element per
  sample, tokens for a language model), so the effective batch is compared with B_noise in the same unit;
* the candidate is the integer factor closest to B_noise / elements_per_factor on a log scale (a batch twice too
  large is as far off as one half too small), clamped to [min_factor, max_factor];
* hysteresis: the factor changes only when the current batch is off the target by more than a ratio of
  (1 + hysteresis) either way, so a noise scale that wobbles near the middle between two factors does not flap;
* no estimate yet (one process with one micro-batch per window, EMA of |G|^2 not positive): the factor is kept.

Only all-reduced numbers enter (they are bit-identical on every rank), so every rank decides the same; the state is
plain numbers in the engine's state_dict, so a resumed run makes the same decisions bit for bit.
"""
from __future__ import annotations

import math
import zlib


class AdaptiveFactor:
    """Decides the accumulation factor from the noise scale. Arguments as in ``accumulation.adaptive``."""

    def __init__(self, min_factor: int = 1, max_factor: int = 16, every_n_steps: int = 10, ema: float = 0.95,
                 hysteresis: float = 0.25):
        for name, value in (("min_factor", min_factor), ("max_factor", max_factor),
                            ("every_n_steps", every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"adaptive {name}={value!r} must be an integer >= 1")
        if max_factor < min_factor:
            raise ValueError(f"adaptive max_factor={max_factor} is below min_factor={min_factor}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"adaptive ema={ema!r} must be in [0, 1)")
        if not hysteresis >= 0.0:
            raise ValueError(f"adaptive hysteresis={hysteresis!r} must be >= 0")
        self.min_factor, self.max_factor = int(min_factor), int(max_factor)
        self.every_n_steps, self.ema, self.hysteresis = int(every_n_steps), float(ema), float(hysteresis)
        self.initial_factor = self.min_factor  # the first windows measure at the smallest batch
        self.factor = self.initial_factor
        self.reason = f"initial: min_factor {self.min_factor}"
        self._steps = 0  # windows since the last decision
        self._elements = 0.0  # their elements and micro-batches (all ranks), for elements per unit of factor
        self._micro = 0

    # -- what the engine asks -----------------------------------------------------------------------------------
    def factor_for(self, position=None) -> int:
        """The factor of the next window (the position does not matter: decisions happen in after_window)."""
        return self.factor

    def factor_at(self, value: int = 0) -> int:
        """The factor LR coupling is relative to (the first windows' factor)."""
        return self.initial_factor

    def fingerprint(self) -> int:
        """A 31-bit hash of the settings and the whole decision state, checked across ranks at each epoch start."""
        text = repr(sorted(self.config().items())) + repr(sorted(self.state_dict().items()))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    def after_window(self, step: int, noise_scale: float | None, elements: float, micro_batches: int) -> None:
        """Feed one finished window (all-reduced numbers); every ``every_n_steps`` windows decide the next factor."""
        self._steps += 1
        self._elements += float(elements)
        self._micro += int(micro_batches)
        if self._steps < self.every_n_steps:
            return
        per_factor = self._elements / self._micro if self._micro else 0.0
        self.factor, self.reason = self.decide(step, noise_scale, per_factor)
        self._steps, self._elements, self._micro = 0, 0.0, 0

    def decide(self, step: int, noise_scale: float | None, per_factor: float) -> tuple[int, str]:
        """(factor, reason) for a noise scale of ``noise_scale`` elements and ``per_factor`` elements per unit."""
        current = self.factor
        if noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0 or not per_factor > 0:
            return current, f"step {step}: keep {current}: no noise-scale estimate yet"
        target = noise_scale / per_factor  # the ideal factor, real-valued
        low = max(1, math.floor(target))
        best = low if target < math.sqrt(low * (low + 1)) else low + 1  # nearest integer on a log scale
        clamp = ""
        if best < self.min_factor:
            best, clamp = self.min_factor, f" (clamped to min_factor {self.min_factor})"
        elif best > self.max_factor:
            best, clamp = self.max_factor, f" (clamped to max_factor {self.max_factor})"
        what = f"noise scale {noise_scale:.4g} = {target:.3g} x {per_factor:.4g} elements"
        if best == current:
            return current, f"step {step}: keep {current}: {what}{clamp}"
        off = noise_scale / (current * per_factor)
        if 1.0 / (1.0 + self.hysteresis) <= off <= 1.0 + self.hysteresis:
            return current, f"step {step}: keep {current}: {what}, within hysteresis {self.hysteresis:g}"
        return best, f"step {step}: {current} -> {best}: {what}{clamp}"

    # -- checkpoints --------------------------------------------------------------------------------------------
    def config(self) -> dict:
        return {"min_factor": self.min_factor, "max_factor": self.max_factor, "every_n_steps": self.every_n_steps,
                "ema": self.ema, "hysteresis": self.hysteresis}

    def state_dict(self) -> dict:
        return {"factor": self.factor, "reason": self.reason, "steps": self._steps, "elements": self._elements,
                "micro_batches": self._micro}

    def load_state_dict(self, state: dict) -> None:
        self.factor, self.reason = int(state["factor"]), str(state["reason"])
        self._steps, self._elements, self._micro = int(state["steps"]), float(state["elements"]), int(
            state["micro_batches"])

    @classmethod
    def build(cls, spec) -> AdaptiveFactor:
        """An AdaptiveFactor from itself or from a mapping of its arguments (``accumulation.adaptive``)."""
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"adaptive={spec!r}: give an AdaptiveFactor or a mapping of its arguments")
        unknown = set(spec) - {"min_factor", "max_factor", "every_n_steps", "ema", "hysteresis"}
        if unknown:
            raise ValueError(f"adaptive: unknown keys {', '.join(sorted(unknown))}")
        return cls(**spec)


__all__ = ["AdaptiveFactor"]
