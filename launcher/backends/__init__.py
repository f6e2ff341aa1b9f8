"""The launcher's back ends, by their ``distributed.backend`` name (the seam is launcher/backends/base.py).

Torch-free: config validation and `accum-sched check` import this on login nodes. Adding a back end is one
module with a :class:`~launcher.backends.base.LauncherBackend` subclass and one line in ``_BACKENDS``; the config's
``distributed.backend`` choices and each back end's option keys (its ``options``) come from here. The back ends never
import launcher.config: they get the validated config as an argument.
"""
from __future__ import annotations

from launcher.backends.base import LauncherBackend, Setup
from launcher.backends.ddp import DDPBackend
from launcher.backends.deepspeed import DeepSpeedBackend
from launcher.backends.fsdp import FSDPBackend

_BACKENDS: dict[str, LauncherBackend] = {b.name: b for b in (DDPBackend(), DeepSpeedBackend(), FSDPBackend())}


def names() -> tuple[str, ...]:
    """distributed.backend's choices, the first the default: read when asked, so a back end registered (one line
    in ``_BACKENDS``) before launcher.config is imported is one of them."""
    return tuple(_BACKENDS)


def get(name: str) -> LauncherBackend:
    """The back end called ``name`` (a validated config's ``distributed.backend``)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no launcher back end {name!r} (known: {', '.join(names())})") from None


def options() -> dict:
    """Every back end's keys of the distributed section, ``{name: (annotation, declaration)}``, in registry order
    (launcher/config/sections.py adds them to DistributedConfig)."""
    out: dict = {}
    for backend in _BACKENDS.values():
        out.update(backend.options)
    return out


def validate(cfg) -> None:
    """The back-end rules of a config: the chosen back end's own, and every other one's while it is unused."""
    chosen = get(cfg.distributed.backend)
    for backend in _BACKENDS.values():
        if backend is not chosen:
            backend.validate_unused(cfg)
    chosen.validate(cfg)


__all__ = ["LauncherBackend", "Setup", "get", "names", "options", "validate"]
