"""The run configuration: schema with defaults, safe YAML loading, `--set a.b=value` overrides, one-line errors.

No torch here (`accum-sched check` runs on login nodes). Validation returns a `Config`: nested read-only sections
with attribute access (`cfg.data.micro_batch_size`) that serialise back to the resolved YAML written to
`output_dir/config.yaml`.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from accum_sched.schedule import UNITS, AccumulationSchedule
from launcher import backends
from launcher.config import noise as noise_config
from launcher.errors import ConfigError

REQUIRED = object()


@dataclass(frozen=True)
class Field:
    kind: str  # int, float, str, bool, mapping, schedule, any, list, section (a nested mapping with its own schema)
    default: Any = REQUIRED
    choices: tuple | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None  # returns a problem ("must be >= 1") or None
    hint: str = ""
    schema: dict | None = None  # kind "section": the nested keys, validated like a section's (a.b.c paths)


def _at_least(low):
    return lambda v: None if v >= low else f"must be >= {low}, got {v}"


def _positive(v):
    return None if v > 0 else f"must be > 0, got {v}"


OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULERS = ("constant", "linear", "cosine", "onecycle")


def _name_or_path(known):
    def check(value):
        from launcher.import_path import looks_like_path

        if value in known or looks_like_path(value):
            return None
        return f"{value!r} is not one of {', '.join(known)} nor an import path"
    return check


def _wrap_value(v):
    if v == "auto":
        return None
    if isinstance(v, list) and v and all(isinstance(c, str) and c.strip() for c in v):
        return None
    return f"expected 'auto' or a non-empty list of module class names, got {v!r}"


DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
# distributed.fsdp (backend: fsdp; launcher/backends/fsdp.py applies them)
FSDP_SCHEMA: dict[str, Field] = {
    "gradient_sync": Field("str", "boundary", choices=("boundary", "every_micro_batch")),
    # module class names to fully_shard one by one before the root, or auto: the model's _no_split_modules
    "wrap": Field("any", "auto", check=_wrap_value, hint="write auto or e.g. [GPT2Block]"),
    "reshard_after_forward": Field("bool", True),
    "param_dtype": Field("str", None, nullable=True, choices=DTYPES),
    "reduce_dtype": Field("str", None, nullable=True, choices=DTYPES),
    "cpu_offload": Field("bool", False),
}


SCHEMA: dict[str, dict[str, Field]] = {
    "run": {
        "output_dir": Field("str", "runs/run"),
        "seed": Field("int", 0),
        "epochs": Field("int", 1, check=_at_least(1)),
        "precision": Field("str", "fp32", choices=("fp32", "bf16", "fp16")),
    },
    "task": {
        "target": Field("str", hint="write 'module:function' or 'builtin:regression'"),
        "args": Field("mapping", {}),
    },
    "data": {
        "micro_batch_size": Field("int", check=_at_least(1)),
        "shuffle": Field("bool", True),
        "drop_last": Field("bool", False),
        "num_workers": Field("int", 0, check=_at_least(0)),
    },
    "accumulation": {
        "schedule": Field("schedule", None, nullable=True),  # None: factor 1, or derived from global_batch
        "global_batch": Field("int", None, nullable=True, check=_at_least(1)),
        "lr_coupling": Field("str", "none", choices=("none", "linear", "sqrt", "adascale")),
        "unit": Field("str", "epoch", choices=UNITS),
        "normalize": Field("str", "elements", choices=("elements", "micro_batches")),
        "uneven": Field("str", "truncate", choices=("truncate", "error")),
        "nonfinite": Field("str", "skip", choices=("skip", "raise")),
        # the gradient noise scale of every window, and a factor that follows it (launcher/config/noise.py)
        "noise_scale": Field("bool", False),
        "adaptive": Field("mapping", None, nullable=True),
    },
    "optimizer": {
        "name": Field("str", "adamw", check=_name_or_path(OPTIMIZERS),
                      hint="use sgd, adam, adamw or an import path such as torch.optim.RMSprop or mypkg.optim:Lion"),
        "args": Field("mapping", {}),  # extra keyword arguments of the optimizer's constructor
        "no_decay": Field("list", []),  # parameter name parts without weight decay, e.g. [bias, norm]
        "lr": Field("float", 1e-3, check=_positive),
        "weight_decay": Field("float", None, nullable=True, check=_at_least(0)),
        "momentum": Field("float", None, nullable=True, check=_at_least(0)),
        "betas": Field("list", None, nullable=True),
        "eps": Field("float", None, nullable=True, check=_positive),
        "max_grad_norm": Field("float", None, nullable=True, check=_positive),
    },
    "lr_scheduler": {
        "name": Field("str", "constant", check=_name_or_path(LR_SCHEDULERS),
                      hint="use constant, linear, cosine, onecycle or an import path such as "
                           "torch.optim.lr_scheduler.StepLR"),
        "args": Field("mapping", {}),  # extra keyword arguments of the scheduler's constructor
        "warmup_steps": Field("int", 0, check=_at_least(0)),
        "min_lr": Field("float", 0.0, check=_at_least(0)),
    },
    # Validation (launcher/train/evaluate.py): after every n epochs and/or every n optimizer steps, when the task returns a
    # val_dataset. monitor/mode choose model-best.pt; early_stop is null or {patience, min_delta}.
    "eval": {
        "every_n_epochs": Field("int", 1, nullable=True, check=_at_least(1)),
        "every_n_steps": Field("int", None, nullable=True, check=_at_least(1)),
        "micro_batch_size": Field("int", None, nullable=True, check=_at_least(1)),
        "monitor": Field("str", "val_loss"),
        "mode": Field("str", "min", choices=("min", "max")),
        "early_stop": Field("any", None, nullable=True),
    },
    "distributed": {
        "backend": Field("str", "ddp", choices=backends.NAMES),
        "nproc_per_node": Field("int", 1, check=_at_least(1)),
        "nnodes": Field("int", 1, check=_at_least(1)),
        "process_group": Field("str", "auto", choices=("auto", "gloo", "nccl")),
        "find_unused_parameters": Field("bool", False),
        "timeout_s": Field("int", 600, check=_at_least(10)),
        "max_restarts": Field("int", 0, check=_at_least(0)),
        "deepspeed_config": Field("any", None, nullable=True),
        "fsdp": Field("section", {k: f.default for k, f in FSDP_SCHEMA.items()}, schema=FSDP_SCHEMA),
    },
    "checkpoint": {
        "every_n_steps": Field("int", None, nullable=True, check=_at_least(1)),
        "keep_last": Field("int", 2, check=_at_least(1)),
        "dir": Field("str", None, nullable=True),
        # resume a checkpoint made under different training fields (see launcher/checkpoint/store.py)
        "force_resume": Field("bool", False),
        # resuming on another world size: error | keep_global_batch | keep_factor (notes/checkpoint.md)
        "on_world_change": Field("str", "error", choices=("error", "keep_global_batch", "keep_factor")),
        # how long ranks wait while rank 0 writes, hashes or verifies a checkpoint (launcher/train/coordination.py)
        "timeout_s": Field("int", 3600, check=_at_least(10)),
    },
    "logging": {
        "progress": Field("str", "auto", choices=("auto", "bar", "plain", "none")),
        "tensorboard": Field("str", "auto", choices=("auto", "on", "off")),
        "log_every": Field("int", 10, check=_at_least(1)),
    },
    # `accum-sched slurm` only (launcher/launch/slurm.py checks the formats); nodes and workers per node come
    # from distributed.nnodes / distributed.nproc_per_node.
    "slurm": {
        "template": Field("str", "torchrun", hint="torchrun, per_task or the path of a .sbatch template"),
        "gpus_per_node": Field("int", 0, check=_at_least(0)),
        "cpus_per_worker": Field("int", 1, check=_at_least(1)),
        "partition": Field("str", None, nullable=True),
        "account": Field("str", None, nullable=True),
        "time": Field("any", None, nullable=True),  # a string: YAML reads an unquoted 1:30:00 as the int 5400
        "job_name": Field("str", None, nullable=True),
        "signal": Field("str", "USR2@90"),
        "requeue": Field("bool", True),
        "extra_sbatch": Field("list", []),
        "setup": Field("list", []),
    },
}
# Sections that may be written as `null` as a whole (e.g. `lr_scheduler: null` for a constant LR).
NULLABLE_SECTIONS = {"lr_scheduler"}
REQUIRED_SECTIONS = {"task", "data"}


class Section:
    """A read-only config section with attribute access."""

    def __init__(self, name: str, values: dict):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"config section {self._name!r} has no key {key!r}") from None

    def __setattr__(self, key, value):
        raise AttributeError("config sections are read-only; use --set or replace()")

    def get(self, key, default=None):
        return self._values.get(key, default)

    def to_dict(self) -> dict:
        return dict(self._values)


class Config:
    """A validated configuration. ``cfg.section.key``; ``cfg.lr_scheduler`` is None when written as null."""

    def __init__(self, sections: dict[str, dict | None]):
        self._sections = {k: (None if v is None else Section(k, v)) for k, v in sections.items()}

    def __getattr__(self, name):
        try:
            return self.__dict__["_sections"][name]
        except KeyError:
            raise AttributeError(f"config has no section {name!r}") from None

    def to_dict(self) -> dict:
        return {k: (None if v is None else v.to_dict()) for k, v in self._sections.items()}

    @property
    def schedule(self) -> AccumulationSchedule:
        return self.schedule_for(self.world_size)

    def schedule_for(self, world_size: int) -> AccumulationSchedule:
        """The schedule at ``world_size`` ranks: as written, or the constant factor of ``global_batch``."""
        acc = self.accumulation
        if acc.global_batch is None:
            return AccumulationSchedule(1 if acc.schedule is None else acc.schedule, acc.unit)
        per_factor = self.data.micro_batch_size * world_size
        if acc.global_batch % per_factor:
            raise ConfigError("accumulation.global_batch",
                              f"{acc.global_batch} is not a multiple of micro_batch_size x world = "
                              f"{self.data.micro_batch_size} x {world_size} = {per_factor}",
                              "choose a global batch that micro x world divides, or change the micro-batch")
        return AccumulationSchedule(acc.global_batch // per_factor, acc.unit)

    @property
    def world_size(self) -> int:
        return self.distributed.nproc_per_node * self.distributed.nnodes


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    known = ", ".join(options)
    return f"did you mean {close[0]!r}? (known: {known})" if close else f"known keys: {known}"


def _coerce(path: str, field: Field, value):
    if value is None:
        if field.nullable:
            return None
        raise ConfigError(path, "must not be null", field.hint or "give a value or remove the key for the default")
    kind = field.kind
    if kind == "schedule":
        return _schedule_value(path, value)
    if kind == "section":
        return _section_value(path, field.schema, value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}", field.hint or "write a whole number")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}", field.hint or "write e.g. 0.001")
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}", "write true or false")
    elif kind == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and field.choices is None:
            value = str(value)  # `--set run.output_dir=123` means the directory "123"
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}", field.hint or "quote the value")
    elif kind == "mapping":
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}", "write key: value pairs, e.g. {a: 1}")
    elif kind == "list":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}", "write e.g. [0.9, 0.999]")
        value = list(value)
    if field.choices is not None and value not in field.choices:
        raise ConfigError(path, f"{value!r} is not one of {', '.join(map(str, field.choices))}",
                          _did_you_mean(str(value), field.choices) if isinstance(value, str) else "")
    if field.check is not None:
        problem = field.check(value)
        if problem:
            raise ConfigError(path, problem, field.hint or "change the value")
    return value


def _section_value(path: str, schema: dict, value) -> dict:
    """A nested mapping checked key by key against ``schema`` (errors name ``path.key``); defaults filled in."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {value!r}", f"write e.g. {{{next(iter(schema))}: ...}}")
    for key in value:
        if key not in schema:
            raise ConfigError(f"{path}.{key}", "unknown key", _did_you_mean(str(key), schema))
    return {key: _coerce(f"{path}.{key}", f, value[key]) if key in value else f.default for key, f in schema.items()}


def _schedule_value(path: str, value):
    """Keep the schedule as plain YAML data ({int: int}, a string or an int); checked later with its unit."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.strip().isdigit() else k): v for k, v in value.items()}
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    raise ConfigError(path, f"expected a mapping {{epoch: factor}}, a string like '0:1,5:2' or an int, got {value!r}",
                      "write e.g. {0: 1, 5: 2, 10: 4}")


def validate(raw: dict) -> Config:
    """Check ``raw`` (parsed YAML) against the schema; fill defaults; raise ConfigError naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError("config", f"the file must hold a mapping of sections, got {type(raw).__name__}",
                          "start with e.g. 'task: {target: builtin:regression}'")
    for name in raw:
        if name not in SCHEMA:
            raise ConfigError(str(name), "unknown section", _did_you_mean(str(name), SCHEMA))
    sections: dict[str, dict | None] = {}
    for name, fields in SCHEMA.items():
        given = raw.get(name, {} if name not in REQUIRED_SECTIONS else None)
        if given is None:
            if name in NULLABLE_SECTIONS and name in raw:
                sections[name] = None
                continue
            if name in REQUIRED_SECTIONS:
                raise ConfigError(name, "section is missing", f"add a '{name}:' section")
            given = {}
        if not isinstance(given, dict):
            raise ConfigError(name, f"expected a mapping, got {given!r}", f"write '{name}: {{key: value}}'")
        for key in given:
            if key not in fields:
                raise ConfigError(f"{name}.{key}", "unknown key", _did_you_mean(str(key), fields))
        values = {}
        for key, field in fields.items():
            path = f"{name}.{key}"
            if key in given:
                values[key] = _coerce(path, field, given[key])
            elif field.default is REQUIRED:
                raise ConfigError(path, "is required", field.hint or f"add '{key}:' under '{name}:'")
            else:
                values[key] = dict(field.default) if field.kind == "section" else field.default
        sections[name] = values
    cfg = Config(sections)
    _cross_check(cfg)
    raw = backends.get(cfg.distributed.backend).resolve_raw(cfg)  # DeepSpeed's JSON may hold the schedule
    if raw is not None:
        cfg = validate(raw)
    return cfg


def _cross_check(cfg: Config) -> None:
    if cfg.accumulation.global_batch is not None and cfg.accumulation.schedule is not None:
        raise ConfigError("accumulation.global_batch", "is given together with accumulation.schedule",
                          "keep one: a schedule of factors, or a fixed global batch")
    try:
        schedule = cfg.schedule
    except ValueError as exc:
        raise ConfigError("accumulation.schedule", str(exc), "see 'accum-sched check' for the accepted forms") from None
    target = cfg.task.target
    if ":" not in target or not all(target.split(":", 1)):
        raise ConfigError("task.target", f"{target!r} is not 'module:function'",
                          "write e.g. 'mypackage.tasks:make_task' or 'builtin:regression'")
    backends.validate(cfg)  # the rules of distributed.backend (launcher/backends/)
    betas = cfg.optimizer.betas
    if betas is not None and (len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError("optimizer.betas", f"{betas!r} is not two numbers in [0, 1)", "write e.g. [0.9, 0.999]")
    name = cfg.optimizer.name  # an import path takes momentum/betas/eps as keywords (checked at worker start)
    if cfg.optimizer.momentum is not None and name in ("adam", "adamw"):
        raise ConfigError("optimizer.momentum", f"applies to sgd only, not {name}",
                          "remove it or use optimizer.betas")
    if cfg.optimizer.betas is not None and name == "sgd":
        raise ConfigError("optimizer.betas", "applies to adam/adamw only", "remove it or use optimizer.momentum")
    if not all(isinstance(p, str) and p for p in cfg.optimizer.no_decay):
        raise ConfigError("optimizer.no_decay", f"{cfg.optimizer.no_decay!r} is not a list of names",
                          "write e.g. [bias, norm]")
    sched = cfg.lr_scheduler
    if sched is not None and sched.name not in LR_SCHEDULERS:
        for key, default in (("warmup_steps", 0), ("min_lr", 0.0)):
            if getattr(sched, key) != default:
                raise ConfigError(f"lr_scheduler.{key}", f"applies to the built-in schedulers, not {sched.name}",
                                  "give the scheduler's own keywords in lr_scheduler.args")
    elif sched is not None and sched.args:
        raise ConfigError("lr_scheduler.args", f"applies to a scheduler given by import path, not {sched.name}",
                          "remove it, or name a scheduler class such as torch.optim.lr_scheduler.StepLR")
    _check_eval(cfg.eval)
    del schedule
    noise_config.check(cfg)


def _check_eval(section) -> None:
    stop = section.early_stop
    if stop is None:
        return
    if not isinstance(stop, dict):
        raise ConfigError("eval.early_stop", f"expected a mapping or null, got {stop!r}",
                          "write e.g. {patience: 3, min_delta: 0.0}")
    for key in stop:
        if key not in ("patience", "min_delta"):
            raise ConfigError(f"eval.early_stop.{key}", "unknown key", "known keys: patience, min_delta")
    patience = stop.get("patience")
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ConfigError("eval.early_stop.patience", f"must be an integer >= 1, got {patience!r}",
                          "stop after this many evaluations without improvement, e.g. 3")
    delta = stop.get("min_delta", 0.0)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or delta < 0:
        raise ConfigError("eval.early_stop.min_delta", f"must be a number >= 0, got {delta!r}",
                          "the least change of eval.monitor that counts as an improvement, e.g. 0.001")


# -- loading ----------------------------------------------------------------------------------------------------
def read_yaml(path: str) -> dict:
    """Safe-load a YAML file; syntax errors become one line with line and column."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"file {path!r} not found", "check the path (accum-sched run CONFIG.yaml)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("config", f"YAML syntax error in {path}{where}: {problem}",
                          "fix the YAML at that position") from None
    return {} if data is None else data


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides (values parsed as YAML, then typed by the schema) to a copy of ``raw``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError("--set", f"{item!r} is not key=value", "write e.g. --set optimizer.lr=0.01")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        nested = len(parts) == 3 and parts[0] in SCHEMA and SCHEMA[parts[0]].get(parts[1]) is not None \
            and SCHEMA[parts[0]][parts[1]].kind == "section"
        if len(parts) != 2 and not nested:
            raise ConfigError("--set", f"{key!r} is not section.key", "write e.g. --set data.micro_batch_size=32")
        section, name = parts[:2]
        if section not in SCHEMA:
            raise ConfigError(section, "unknown section", _did_you_mean(section, SCHEMA))
        if name not in SCHEMA[section]:
            raise ConfigError(key, "unknown key", _did_you_mean(name, SCHEMA[section]))
        if nested:
            schema = SCHEMA[section][name].schema
            if parts[2] not in schema:
                raise ConfigError(key, "unknown key", _did_you_mean(parts[2], schema))
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        field = SCHEMA[section][name].schema[parts[2]] if nested else SCHEMA[section][name]
        if field.kind == "str" and not isinstance(value, str) and value is not None:
            value = text  # typed by the schema: a string field keeps the text as written
        current = out.get(section)
        out[section] = dict(current) if isinstance(current, dict) else {}
        if nested:
            inner = out[section].get(name)
            out[section][name] = dict(inner) if isinstance(inner, dict) else {}
            out[section][name][parts[2]] = value
        else:
            out[section][name] = value
    return out


def load_config(path: str, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config file."""
    return validate(apply_overrides(read_yaml(path), overrides or []))


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: Config, path: str) -> None:
    """Write the resolved config atomically (temporary file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dump(cfg))
    os.replace(tmp, path)
