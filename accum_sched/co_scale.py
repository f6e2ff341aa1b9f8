"""Co-scaling the optimizer with the effective batch: learning rate, Adam's beta2 and weight decay.

When the factor changes, the effective batch goes from B0 (the first window's) to B = B0 x r, r = factor / first
factor (micro-batch size and world size are fixed within a run; a resume on another world size rescales the schedule
so that r is kept). Each rule is a pure function of r, applied to every optimizer step of a window on top of what
the optimizer's param groups hold (which the LR scheduler and the checkpoints see unchanged):

* ``lr``: ``linear`` (LR x r; Goyal et al. 2017), ``sqrt`` (LR x sqrt(r); the update noise's variance kept, the rule
  for Adam-family optimizers), ``auto`` (sqrt for optimizers with ``betas``, linear for SGD), ``none``.
* ``beta2``: ``half_life`` keeps the half-life of Adam's second-moment average constant in samples:
  beta2 <- beta2_0 ** r (Marek et al. 2025). With r x fewer steps per sample, each step weighs r x more.
* ``weight_decay``: ``tau`` keeps the AdamW timescale tau = B / (eta x lambda x D) fixed (Wang & Aitchison 2024;
  "Power Lines" 2025): lambda <- lambda_0 x r x (eta_0 / eta), where eta / eta_0 is the ``lr`` rule's multiplier
  (the LR scheduler's own decay is the user's schedule, not the batch's, and is left out). With ``lr: linear`` the
  decay stays, with ``sqrt`` it grows by sqrt(r), with ``none`` by r.

Because the multipliers depend on r alone and the param groups keep their base values, a resumed run applies the
same numbers from its first step: nothing beyond the schedule needs saving.
"""
from __future__ import annotations

import dataclasses
import math

LR_RULES = ("none", "linear", "sqrt", "auto")
BETA2_RULES = ("none", "half_life")
WEIGHT_DECAY_RULES = ("none", "tau")
KEYS = {"lr": LR_RULES, "beta2": BETA2_RULES, "weight_decay": WEIGHT_DECAY_RULES}


@dataclasses.dataclass(frozen=True)
class GroupScale:
    """What one optimizer step changes in every param group, restored after it (accum_sched.step_rules.scaled_lr):
    ``lr`` x ``lr``, ``betas[1]`` ** ``beta2_power`` and ``weight_decay`` x ``weight_decay`` (None: untouched)."""

    lr: float = 1.0
    beta2_power: float | None = None
    weight_decay: float | None = None

    def is_identity(self) -> bool:
        return self.lr == 1.0 and self.beta2_power in (None, 1.0) and self.weight_decay in (None, 1.0)


def validate(rules: dict | None) -> dict:
    """The rules with their defaults (``none``), or ValueError naming the key and what it may be."""
    rules = dict(rules or {})
    unknown = set(rules) - set(KEYS)
    if unknown:
        raise ValueError(f"co_scale: unknown key(s) {', '.join(sorted(map(str, unknown)))}; the keys are "
                         f"{', '.join(KEYS)}")
    out = {}
    for key, allowed in KEYS.items():
        value = rules.get(key, "none")
        if value not in allowed:
            raise ValueError(f"co_scale.{key}={value!r} is not one of {', '.join(allowed)}")
        out[key] = value
    return out


def has_betas(param_groups) -> bool:
    return bool(param_groups) and all(isinstance(g.get("betas"), (tuple, list)) and len(g["betas"]) == 2
                                      for g in param_groups)


def resolve(rules: dict, param_groups, optimizer_name: str) -> dict:
    """Fix ``lr: auto`` for this optimizer and refuse what cannot apply (ValueError with the fix)."""
    rules = dict(rules)
    betas = has_betas(param_groups)
    if rules["lr"] == "auto":
        if betas:
            rules["lr"] = "sqrt"
        elif optimizer_name.lower().startswith("sgd"):
            rules["lr"] = "linear"
        else:
            raise ValueError(f"co_scale.lr=auto: {optimizer_name} is neither Adam-family (betas) nor SGD, so there "
                             f"is no rule to pick; set co_scale.lr to linear or sqrt")
    if rules["beta2"] != "none" and not betas:
        raise ValueError(f"co_scale.beta2={rules['beta2']}: {optimizer_name} has no betas; set co_scale.beta2 "
                         f"to none, or use an Adam-family optimizer")
    if rules["weight_decay"] != "none" and not all("weight_decay" in g for g in param_groups):
        raise ValueError(f"co_scale.weight_decay={rules['weight_decay']}: {optimizer_name} has no weight_decay; "
                         f"set co_scale.weight_decay to none")
    return rules


def lr_multiplier(rule: str, ratio: float) -> float:
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def group_scale(rules: dict, ratio: float, lr: float) -> GroupScale:
    """The step's changes for an effective batch ``ratio`` x the first one; ``lr`` is the LR multiplier in use
    (from the ``lr`` rule, or from ``lr_coupling``, e.g. AdaScale's gain)."""
    return GroupScale(lr=lr, beta2_power=ratio if rules["beta2"] == "half_life" else None,
                      weight_decay=ratio / lr if rules["weight_decay"] == "tau" else None)


def reported(param_groups, scale: GroupScale | float) -> tuple[float | None, float | None]:
    """(beta2, weight_decay) a step ran with, for metrics: the first group with weight decay (a no_decay group has
    none to report) and its beta2; None where the optimizer has no such setting."""
    if not param_groups:
        return None, None
    group = next((g for g in param_groups if g.get("weight_decay")), param_groups[0])
    betas = group.get("betas")  # has_betas([group]), inline: this runs at every optimizer step
    beta2 = betas[1] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    wd = group.get("weight_decay")
    if isinstance(scale, GroupScale):
        if beta2 is not None and scale.beta2_power is not None:
            beta2 = beta2 ** scale.beta2_power
        if wd is not None and scale.weight_decay is not None:
            wd = wd * scale.weight_decay
    return (None if beta2 is None else float(beta2)), (None if wd is None else float(wd))
