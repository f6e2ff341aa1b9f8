"""Optimizers and LR schedulers from the config: built-in names or any class (or factory) by import path.

LR totals come from the schedule-aware optimizer-step count. Errors are one-line ConfigErrors naming the field;
what `accum-sched check` cannot know without importing (the class, its keywords) is checked here, at worker start.
"""
from __future__ import annotations

import inspect
import math

import torch

from launcher import import_path
from launcher.errors import ConfigError

BUILTIN_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# Keywords that name the length of the run: filled with the planned optimizer steps unless lr_scheduler.args has them.
TOTAL_KEYWORDS = ("total_steps", "T_max", "total_iters", "num_training_steps")


def _keywords(target) -> tuple[set[str], bool]:
    """The keyword names ``target(...)`` accepts, and whether it takes **kwargs too."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def _check_keywords(target, kwargs: dict, fields: dict, name: str) -> None:
    accepted, open_ended = _keywords(target)
    if open_ended:
        return
    for key in kwargs:
        if key not in accepted:
            raise ConfigError(fields.get(key, f"{fields['*']}.{key}"), f"{name} takes no keyword {key!r}",
                              f"remove it; {name} accepts "
                              f"{', '.join(sorted(accepted - {'self', 'params', 'optimizer'}))}")


def param_groups(params, no_decay) -> list:
    """Parameters as given, or two groups when ``no_decay`` is set: the second without weight decay.

    An entry of ``no_decay`` matches a parameter when it is part of the parameter's qualified name or of the class
    name of the module that owns it (case-insensitive): ``bias`` finds ``fc.bias``, ``norm`` finds every parameter
    of a LayerNorm/BatchNorm/RMSNorm whatever its attribute is called.
    """
    if not no_decay:
        return list(params.parameters()) if isinstance(params, torch.nn.Module) else params
    if not isinstance(params, torch.nn.Module):
        raise ConfigError("optimizer.no_decay", "needs the model's parameter names, but only parameters were given",
                          "pass the model itself to build_optimizer")
    wanted = [w.lower() for w in no_decay]
    decay, plain = [], []
    for module_name, module in params.named_modules():
        owner = type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{module_name}.{name}".lower() if module_name else name.lower()
            (plain if any(w in full or w in owner for w in wanted) else decay).append(p)
    groups = [{"params": decay}] if decay else []
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


def _optimizer_call(section):
    """``(class or factory, keyword arguments, config field of each keyword)`` for ``optimizer``; checked."""
    name = section.name
    builtin = name in BUILTIN_OPTIMIZERS
    target = BUILTIN_OPTIMIZERS[name] if builtin else import_path.load("optimizer.name", name)
    not_optimizer = not callable(target) or (isinstance(target, type)
                                             and not issubclass(target, torch.optim.Optimizer))
    if not_optimizer:
        raise ConfigError("optimizer.name", f"{name!r} is not an optimizer (it is {target!r})",
                          "name a torch.optim.Optimizer subclass, e.g. torch.optim.RMSprop")
    kwargs, fields = {"lr": section.lr}, {"lr": "optimizer.lr", "*": "optimizer.args"}
    common = {"weight_decay": section.weight_decay, "momentum": section.momentum,
              "betas": None if section.betas is None else tuple(section.betas), "eps": section.eps}
    if name == "sgd":
        common["betas"] = common["eps"] = None  # cross-checked in config.py; SGD has neither
    for key, value in common.items():
        if value is not None:
            kwargs[key], fields[key] = value, f"optimizer.{key}"
    for key, value in section.args.items():
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    _check_keywords(target, kwargs, fields, name)
    return target, kwargs


def build_optimizer(section, params):
    """The optimizer ``optimizer.name`` names (sgd, adam, adamw or an import path), for ``params`` (the model, or
    its parameters), with ``lr``, the optional common fields and ``optimizer.args``; torch's defaults otherwise."""
    name = section.name
    target, kwargs = _optimizer_call(section)
    try:
        optimizer = target(param_groups(params, section.no_decay), **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError("optimizer.args", f"{name} rejected its arguments ({exc})",
                          "fix optimizer.args (or lr, weight_decay, momentum, betas, eps)") from None
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise ConfigError("optimizer.name", f"{name!r} did not build an optimizer (no param_groups/step)",
                          "name a torch.optim.Optimizer subclass")
    return optimizer


def lr_multiplier(name: str, step: int, total: int, warmup: int, floor: float) -> float:
    """LR / base LR after ``step`` optimizer steps: linear warm-up, then constant, linear or cosine decay to floor."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if name == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_lr_scheduler(section, optimizer, total_steps: int):
    """None for a constant LR without warm-up; otherwise a scheduler stepped once per optimizer step."""
    if section is None:
        return None
    total = max(1, total_steps)
    if "." in section.name or ":" in section.name:
        return _scheduler_by_path(section, optimizer, total)
    if section.name == "onecycle":
        pct = min(0.99, max(section.warmup_steps / total, 1.0 / total)) if section.warmup_steps else 0.3
        max_lr = [g["lr"] for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total, pct_start=pct)
    base = optimizer.param_groups[0]["lr"]
    floor = min(1.0, section.min_lr / base) if base else 0.0
    name, warmup = section.name, section.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(name, s, total, warmup, floor))


def _scheduler_call(section, total: int):
    name = section.name
    target = import_path.load("lr_scheduler.name", name)
    if not callable(target):
        raise ConfigError("lr_scheduler.name", f"{name!r} is not an LR scheduler class or factory",
                          "name e.g. torch.optim.lr_scheduler.StepLR")
    kwargs = dict(section.args)
    accepted, _ = _keywords(target)
    for key in TOTAL_KEYWORDS:
        if key in accepted and key not in kwargs:
            kwargs[key] = total
    _check_keywords(target, kwargs, {"*": "lr_scheduler.args"}, name)
    if isinstance(target, type) and callable(getattr(target, "step", None)):
        _check_step(name, target.step, bound=False)
    return target, kwargs


def _check_step(name: str, step, bound: bool) -> None:
    """The engine calls ``scheduler.step()`` once per optimizer step: a step that needs an argument cannot work."""
    params = list(inspect.signature(step).parameters.values())[0 if bound else 1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.default is p.empty and p.kind in positional]
    if required:  # ReduceLROnPlateau: step(metrics)
        raise ConfigError("lr_scheduler.name", f"{name}.step needs {', '.join(required)}",
                          "use a scheduler stepped once per optimizer step without arguments")


def check_config(cfg) -> None:
    """Before launch (`accum-sched run`): import what optimizer/lr_scheduler name and check their keywords, so a
    typo is one line and exit 2 instead of a failed worker group. Builds nothing."""
    _optimizer_call(cfg.optimizer)
    if cfg.lr_scheduler is not None and cfg.lr_scheduler.name not in ("constant", "linear", "cosine", "onecycle"):
        _scheduler_call(cfg.lr_scheduler, 1)


def _scheduler_by_path(section, optimizer, total: int):
    """A scheduler class or factory by import path: ``target(optimizer, **args)``, with a run-length keyword it
    takes (total_steps, T_max, total_iters, num_training_steps) filled with the planned optimizer steps."""
    name = section.name
    target, kwargs = _scheduler_call(section, total)
    try:
        scheduler = target(optimizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError("lr_scheduler.args", f"{name} rejected its arguments ({exc})",
                          "fix lr_scheduler.args") from None
    step = getattr(scheduler, "step", None)
    if not callable(step) or not callable(getattr(scheduler, "state_dict", None)):
        raise ConfigError("lr_scheduler.name", f"{name!r} did not build an LR scheduler (no step/state_dict)",
                          "name a torch.optim.lr_scheduler.LRScheduler subclass or a factory returning one")
    _check_step(name, step, bound=True)
    return scheduler
