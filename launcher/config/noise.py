"""Config checks for `accumulation.noise_scale` and `accumulation.adaptive` (torch-free, called by config.validate).

Everything the engine would refuse at start-up is refused here first, naming the field, so nothing is launched.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import Field, TypeAdapter
from pydantic_core import PydanticCustomError

from launcher.errors import ConfigError
from launcher.options import options


@options
class AdaptiveOptions:
    """``accumulation.adaptive``, with accum_sched.adaptive.AdaptiveFactor's defaults."""

    min_factor: Annotated[int, Field(ge=1)] = 1
    max_factor: Annotated[int, Field(ge=1)] = 16
    every_n_steps: Annotated[int, Field(ge=1)] = 10
    ema: Annotated[float, Field(ge=0, lt=1)] = 0.95
    hysteresis: Annotated[float, Field(ge=0)] = 0.25

    def __post_init__(self):
        if self.max_factor < self.min_factor:
            raise PydanticCustomError("check", "{problem}", {
                "problem": f"{self.max_factor} is below min_factor {self.min_factor}", "field": "max_factor",
                "hint": "give max_factor >= min_factor"})


# LR schedulers whose shape needs the run's optimizer-step total (unknown when the factor adapts)
NEEDS_TOTAL = ("linear", "cosine", "onecycle")


def adaptive_settings(raw: dict) -> dict:
    """``accumulation.adaptive`` (validated with the config) with its defaults filled in."""
    return dataclasses.asdict(TypeAdapter(AdaptiveOptions).validate_python(raw))


def measuring_field(acc) -> str | None:
    """The key that asks for the noise scale to be measured (``accumulation.noise_scale``, or ``accumulation.adaptive``
    when only the adaptive factor does), named in the errors of the rules that follow; None when nothing is."""
    if acc.noise_scale:
        return "accumulation.noise_scale"
    return "accumulation.adaptive" if acc.adaptive is not None else None


def check(cfg) -> None:
    """Refuse combinations the measurement or the adaptive factor cannot honour (a back end's own limits, e.g.
    DeepSpeed's ZeRO stage 0 in fp32, are its validate(): launcher/backends/)."""
    acc = cfg.accumulation
    adaptive = acc.adaptive
    measuring = acc.noise_scale or adaptive is not None
    if adaptive is not None:
        settings = adaptive_settings(adaptive)  # already valid: the config's model checked it
        if cfg.world_size == 1 and settings["min_factor"] < 2:
            raise ConfigError("accumulation.adaptive.min_factor", "1 gives no noise-scale estimate in one process (it "
                              "compares the micro-batches of a window, and a window of one has a single batch size)",
                              "set min_factor: 2, or run on several ranks")
        for key in ("schedule", "global_batch"):
            if acc.get(key) is not None:
                raise ConfigError(f"accumulation.{key}", "is given together with accumulation.adaptive",
                                  "keep one: the adaptive factor replaces the schedule")
        if acc.unit != "epoch":
            raise ConfigError("accumulation.unit", f"{acc.unit!r} keys a schedule, and accumulation.adaptive has "
                              "none", "remove accumulation.unit")
        scheduler = cfg.lr_scheduler
        if scheduler is not None and scheduler.name in NEEDS_TOTAL:
            raise ConfigError("lr_scheduler.name", f"{scheduler.name} needs the run's optimizer-step total, which "
                              "accumulation.adaptive does not know in advance",
                              "use name: constant (warmup_steps still work) or lr_scheduler: null")
    if acc.lr_coupling == "adascale" and not measuring:
        raise ConfigError("accumulation.lr_coupling", "adascale needs the measured noise scale",
                          "set accumulation.noise_scale: true (or use accumulation.adaptive)")
    if not measuring:
        return
    field = measuring_field(acc)
    if acc.normalize != "elements":
        raise ConfigError(field, "needs accumulation.normalize: elements (per-element mean gradients)",
                          "set accumulation.normalize: elements")
    if cfg.run.precision == "fp16":
        raise ConfigError(field, "is not measured under fp16 (loss-scaled local gradients)",
                          "use run.precision: bf16 or fp32")
