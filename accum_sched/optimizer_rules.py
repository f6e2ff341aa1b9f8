"""OptimizerRules: what each optimizer step multiplies the optimizer's settings by as the effective batch changes.

The engine's part for LR coupling (``lr_coupling``: none, linear, sqrt, AdaScale) and co-scaling (``co_scale``: the
LR, Adam's beta2 and weight decay, :mod:`accum_sched.co_scale`). It is a pure function of the window's factor (and,
for AdaScale, the measured noise scale): nothing to save, and a resumed run applies the same numbers from its first
step. The multipliers apply to one step only (:func:`accum_sched.step_rules.scaled_lr`); the param groups, the LR
scheduler and the checkpoints see the base values.
"""
from __future__ import annotations

from accum_sched import co_scale

LR_COUPLING = ("none", "linear", "sqrt", "adascale")


class OptimizerRules:
    """Args:
        lr_coupling: ``"none"``, ``"linear"`` (LR x factor / first factor), ``"sqrt"`` or ``"adascale"``.
        rules: ``co_scale``'s mapping (``lr``, ``beta2``, ``weight_decay``) or None; its ``lr`` is ``lr_coupling``
            under another name (give one of them).
        param_groups: the stepping optimizer's param groups (``lr: auto`` is fixed from them, and what cannot apply
            is refused).
        optimizer_name: for messages and ``lr: auto`` (SGD: linear).
        first_factor: the factor the effective batch is relative to (the schedule's, or the adaptive controller's,
            first).
    """

    def __init__(self, lr_coupling: str, rules: dict | None, param_groups, optimizer_name: str, first_factor: int):
        if lr_coupling not in LR_COUPLING:
            raise ValueError(f"lr_coupling={lr_coupling!r} is not one of {', '.join(LR_COUPLING)}")
        rules = co_scale.validate(rules)
        if lr_coupling != "none":
            if rules["lr"] not in ("none", lr_coupling):
                raise ValueError(f"lr_coupling={lr_coupling!r} and co_scale lr={rules['lr']!r} disagree: give one")
            if lr_coupling != "adascale":  # AdaScale's gain is the LR rule then; beta2 and weight decay may follow
                rules["lr"] = lr_coupling
        self.rules = co_scale.resolve(rules, param_groups, optimizer_name)
        self.lr_coupling = self.rules["lr"] if self.rules["lr"] != "none" else lr_coupling
        self.first_factor = first_factor
        self._lr_only = self.rules["beta2"] == "none" and self.rules["weight_decay"] == "none"

    def lr_scale(self, factor: int, noise_scale: float | None = None, size: int = 1, elements: float = 0.0) -> float:
        """LR multiplier for a window of ``factor``: effective batch relative to the first factor's.

        Linear keeps LR / batch constant (Goyal et al. 2017); sqrt keeps the update noise's variance constant.
        Smith et al. 2017 argue the other way round (grow the batch *instead of* decaying the LR), which is why
        the default is none. AdaScale (Johnson et al. 2020) uses the gain (B_noise/B0 + 1) / (B_noise/B + 1) of
        this window's batch B (``elements`` over all ranks, in ``size`` micro-batches) over the first factor's
        batch B0 (between 1 and B/B0; 1 while there is no estimate).
        """
        if self.lr_coupling == "none":
            return 1.0
        if self.lr_coupling == "adascale":
            if noise_scale is None or not noise_scale > 0 or not elements > 0:
                return 1.0
            batch = float(elements)
            base = batch * self.first_factor / size  # the first factor's batch at this window's elements per micro
            return (noise_scale / base + 1.0) / (noise_scale / batch + 1.0)
        ratio = factor / self.first_factor
        return ratio if self.lr_coupling == "linear" else ratio ** 0.5

    def step_scale(self, factor: int, lr_scale: float):
        """What this step changes in the optimizer's groups: the LR multiplier alone (a float), or a
        :class:`~accum_sched.co_scale.GroupScale` when beta2 or weight decay follow the batch too."""
        if self._lr_only:
            return lr_scale
        scale = co_scale.group_scale(self.rules, factor / self.first_factor, lr_scale)
        return lr_scale if scale.is_identity() else scale

    @staticmethod
    def reported(param_groups, scale) -> tuple[float | None, float | None]:
        """(beta2, weight decay) the step runs with, for metrics (:func:`accum_sched.co_scale.reported`)."""
        return co_scale.reported(param_groups, scale)


__all__ = ["LR_COUPLING", "OptimizerRules"]
