"""The run configuration: validation against the sections, safe YAML loading, `--set a.b=value` overrides,
one-line errors.

The keys are declared in sections.py (frozen dataclasses); ``SCHEMA`` is their validation view, ``{section: {key:
Field}}``, derived from the declarations. No torch here (`accum-sched check` runs on login nodes). Validation
returns a `Config` of read-only sections with attribute access (`cfg.data.micro_batch_size`) that serialise back to
the resolved YAML written to `output_dir/config.yaml`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from launcher import backends
from launcher.config import noise as noise_config
from launcher.config import sections
from launcher.config import trackers as trackers_config
from launcher.config.sections import LR_SCHEDULERS, OPTIMIZERS, Config, Section  # noqa: F401 (re-exported)
from launcher.errors import ConfigError

REQUIRED = object()  # the default of a required key


@dataclass(frozen=True)
class Field:
    """How one key is validated, derived from its declaration in sections.py."""

    kind: str  # int, float, str, bool, mapping, schedule, any, list, section (a nested mapping with its own schema)
    default: Any = REQUIRED
    choices: tuple | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None  # returns a problem ("must be >= 1") or None
    hint: str = ""
    schema: dict | None = None  # kind "section": the nested keys, validated like a section's (a.b.c paths)
    doc: str = ""  # the key's line in the reference (python -m launcher.config.reference)
    train: bool = False  # part of the checkpoint's config hash (launcher/checkpoint/store.py: training_config)


_KINDS = {int: "int", float: "float", str: "str", bool: "bool", dict: "mapping", list: "list"}


def _kind(annotation) -> tuple[str, bool]:
    """``(kind, nullable)`` of a type annotation: ``int | None`` is ("int", True), a union of several is "any"."""
    args = typing.get_args(annotation)
    nullable = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        nullable = len(rest) < len(args)
        annotation = rest[0] if len(rest) == 1 else Any
    base = typing.get_origin(annotation) or annotation
    if isinstance(base, type) and issubclass(base, sections.Section):
        return "section", nullable
    return _KINDS.get(base, "any"), nullable


def fields_of(cls) -> dict[str, Field]:
    """The validation view of a section dataclass: ``{key: Field}`` in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kind, nullable = _kind(hints[f.name])
        kind = meta.get("kind") or kind
        schema = fields_of(f.default_factory) if kind == "section" else None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = made.to_dict() if isinstance(made, sections.Section) else made
        else:
            default = REQUIRED
        out[f.name] = Field(kind, default, meta.get("choices"), nullable, meta.get("check"), meta.get("hint", ""),
                            schema, meta.get("doc", ""), bool(meta.get("train")))
    return out


_CONFIG_HINTS = typing.get_type_hints(Config)


def _section_class(annotation) -> type:
    """RunConfig of ``RunConfig``, LRSchedulerConfig of ``LRSchedulerConfig | None``."""
    return next(a for a in typing.get_args(annotation) or (annotation,) if a is not type(None))


SECTION_CLASSES: dict[str, type] = {f.name: _section_class(_CONFIG_HINTS[f.name]) for f in dataclasses.fields(Config)}
SCHEMA: dict[str, dict[str, Field]] = {name: fields_of(cls) for name, cls in SECTION_CLASSES.items()}
FSDP_SCHEMA: dict[str, Field] = SCHEMA["distributed"]["fsdp"].schema


def key_paths() -> dict[str, Field]:
    """Every key by its full path (``distributed.fsdp.param_dtype``), a nested section's keys in place of the
    section. A key inside a nested section is training-relevant when it and its section both are marked so."""
    out = {}

    def walk(prefix: str, fields: dict[str, Field], train: bool) -> None:
        for name, field in fields.items():
            if field.kind == "section":
                walk(f"{prefix}{name}.", field.schema, train and field.train)
            else:
                out[f"{prefix}{name}"] = dataclasses.replace(field, train=train and field.train)
    for section, fields in SCHEMA.items():
        walk(f"{section}.", fields, True)
    return out


# Sections that may be written as `null` as a whole (e.g. `lr_scheduler: null` for a constant LR).
NULLABLE_SECTIONS = {name for name in SCHEMA if _kind(_CONFIG_HINTS[name])[1]}
REQUIRED_SECTIONS = {name for name, keys in SCHEMA.items() if any(f.default is REQUIRED for f in keys.values())}


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
            raise ConfigError(path, f"expected a list, got {value!r}", field.hint or "write e.g. [0.9, 0.999]")
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
    built: dict[str, Section | None] = {}
    for name, fields in SCHEMA.items():
        given = raw.get(name, {} if name not in REQUIRED_SECTIONS else None)
        if given is None:
            if name in NULLABLE_SECTIONS and name in raw:
                built[name] = None
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
        built[name] = sections.make(SECTION_CLASSES[name], values)
    cfg = Config(**built)
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
    _check_compile(cfg.run.compile)
    _check_co_scale(cfg)
    _check_schedule_from(cfg)
    del schedule
    noise_config.check(cfg)
    trackers_config.check(cfg)


def _mapping_of(field: str, value, keys: tuple, example: str) -> bool:
    """False for null; True for a mapping of known keys; ConfigError otherwise (the unknown key named)."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise ConfigError(field, f"expected a mapping or null, got {value!r}", f"write e.g. {example}")
    for k in value:
        if k not in keys:
            raise ConfigError(f"{field}.{k}", "unknown key", _did_you_mean(str(k), keys))
    return True


def _check_co_scale(cfg: Config) -> None:
    """``accumulation.co_scale``: known keys and rules, one LR rule (``lr_coupling`` is its alias), and rules the
    named optimizer can take (an optimizer given by import path is checked when the worker builds it)."""
    from accum_sched import co_scale

    acc, field = cfg.accumulation, "accumulation.co_scale"
    rules = acc.co_scale
    if not _mapping_of(field, rules, tuple(co_scale.KEYS), "{lr: auto, beta2: half_life, weight_decay: tau}"):
        return
    for k, value in rules.items():
        allowed = co_scale.KEYS[k]
        if value not in allowed:
            raise ConfigError(f"{field}.{k}", f"{value!r} is not one of {', '.join(allowed)}",
                              _did_you_mean(str(value), allowed) if isinstance(value, str) else "")
    lr = rules.get("lr", "none")
    if acc.lr_coupling != "none" and lr not in ("none", acc.lr_coupling):
        raise ConfigError(f"{field}.lr", f"is {lr} but accumulation.lr_coupling is {acc.lr_coupling}",
                          "keep one of them (lr_coupling is the same rule under its older name)")
    name = cfg.optimizer.name
    if rules.get("beta2", "none") != "none" and name == "sgd":
        raise ConfigError(f"{field}.beta2", f"{rules['beta2']} needs an optimizer with betas, and sgd has none",
                          "set beta2: none, or use optimizer.name: adamw")


def _check_schedule_from(cfg: Config) -> None:
    """``accumulation.schedule_from``: a rule that converts the configured LR scheduler, alone (docs/batch-size.md)."""
    from accum_sched import schedule_from

    acc, field = cfg.accumulation, "accumulation.schedule_from"
    spec = acc.schedule_from
    if not _mapping_of(field, spec, schedule_from.KEYS, "{rule: seesaw, max_factor: 8}"):
        return
    if spec.get("rule") not in schedule_from.RULES:
        raise ConfigError(f"{field}.rule", f"{spec.get('rule')!r} is not one of {', '.join(schedule_from.RULES)}",
                          "write rule: smith or rule: seesaw")
    cap = spec.get("max_factor", 8)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigError(f"{field}.max_factor", f"{cap!r} is not an integer >= 1", "write e.g. max_factor: 8")
    for other in ("schedule", "global_batch", "adaptive"):
        if acc[other] is not None:
            raise ConfigError(field, f"is given together with accumulation.{other}",
                              "keep one: schedule_from derives the schedule from the LR scheduler")
    lr_rule = (acc.co_scale or {}).get("lr", "none") if isinstance(acc.co_scale, dict) else "none"
    if acc.lr_coupling != "none" or lr_rule != "none":
        raise ConfigError(field, "sets the LR of every step itself, so an LR rule on top would count the batch twice",
                          "set accumulation.lr_coupling and co_scale.lr to none (beta2 and weight_decay may follow)")
    if acc.unit not in schedule_from.UNITS:
        raise ConfigError("accumulation.unit", f"is {acc.unit}, which schedule_from cannot place factors in",
                          f"use one of {', '.join(schedule_from.UNITS)}")
    if cfg.lr_scheduler is None or (cfg.lr_scheduler.name == "constant"):
        raise ConfigError(field, "has no LR decay to convert (lr_scheduler is null or constant)",
                          "configure the LR scheduler you would decay with, e.g. {name: cosine}")


COMPILE_KEYS = ("mode", "dynamic", "fullgraph")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_compile(value) -> None:
    """``run.compile``: false, true, or a mapping of torch.compile's ``mode``, ``dynamic``, ``fullgraph``."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise ConfigError("run.compile", f"expected true, false or a mapping, got {value!r}",
                          "write run.compile: true, or e.g. {mode: default, dynamic: false}")
    for k in value:
        if k not in COMPILE_KEYS:
            raise ConfigError(f"run.compile.{k}", "unknown key", _did_you_mean(str(k), COMPILE_KEYS))
    mode = value.get("mode")
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError("run.compile.mode", f"{mode!r} is not one of {', '.join(COMPILE_MODES)}",
                          _did_you_mean(str(mode), COMPILE_MODES) if isinstance(mode, str) else "")
    dynamic = value.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ConfigError("run.compile.dynamic", f"expected true, false or null, got {dynamic!r}",
                          "null lets torch.compile decide (it marks a size dynamic when it changes)")
    if not isinstance(value.get("fullgraph", False), bool):
        raise ConfigError("run.compile.fullgraph", f"expected true or false, got {value['fullgraph']!r}",
                          "write true or false")


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
MAX_YAML_VALUES = 200_000  # values a config may expand to, aliases followed (docs/reliability.md: alias bombs)


def safe_load(text: str, field: str = "config"):
    """``yaml.safe_load`` that refuses, with one line naming ``field``, a document whose aliases expand it past
    MAX_YAML_VALUES values (a "billion laughs" bomb: a few lines that become 9**9 strings once hashed or dumped), an
    alias to itself, or nesting too deep for the parser. The node graph is measured before anything is built."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(field, "the YAML is nested too deeply", "flatten it (a config needs a few levels)") \
                from None
        if node is None:
            return None
        _expanded_size(node, field, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node, field: str, sizes: dict, open_: set) -> int:
    """How many values ``node`` holds with every alias expanded (each shared node measured once)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ConfigError(field, "a YAML alias refers to the node that holds it (an endless value)",
                          "write the value out instead of the alias")
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, field, sizes, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, field, sizes, open_) + _expanded_size(v, field, sizes, open_)
                    for k, v in node.value)
    open_.discard(key)
    if size > MAX_YAML_VALUES:
        raise ConfigError(field, f"the YAML expands to more than {MAX_YAML_VALUES} values through its aliases "
                          "(an alias bomb?)", "write the values out, without nested anchors and aliases (*name)")
    sizes[key] = size
    return size


def read_yaml(path: str) -> dict:
    """Safe-load a YAML file; syntax errors become one line with line and column. The file must be UTF-8, hold a
    mapping of sections and stay within MAX_YAML_VALUES once its aliases are expanded."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"file {path!r} not found", "check the path (accum-sched run CONFIG.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
                          "save the config as UTF-8 YAML") from None
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("config", f"YAML syntax error in {path}{where}: {problem}",
                          "fix the YAML at that position") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError("config", f"{path} holds a {type(data).__name__}, not a mapping of sections",
                          "start with e.g. 'task: {target: builtin:regression}'")
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
            value = safe_load(text, f"--set {key}") if text.strip() else ""
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
