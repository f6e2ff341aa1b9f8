"""The run configuration: validation against the typed sections, safe YAML loading, `--set a.b.c=value`
overrides, one-line errors.

The keys are declared in sections.py and in each back end's module (launcher/options.py makes them pydantic
dataclasses); pydantic validates, and :func:`validate` turns its first error into the one-line ConfigError (the
key's path, what is wrong, how to fix it). ``SCHEMA`` is the declarations' view, ``{section: {key: Field}}``, for
the reference in docs/cli.md, the config hash and --set. No torch here (`accum-sched check` runs on login nodes).
Validation returns a `Config` of read-only sections with attribute access (`cfg.data.micro_batch_size`) that
serialise back to the resolved YAML written to `output_dir/config.yaml`.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import yaml

from accum_sched import schedule_from
from launcher import backends
from launcher.config import noise as noise_config
from launcher.config import sections
from launcher.config.errors import config_error, did_you_mean
from launcher.config.sections import LR_SCHEDULERS, OPTIMIZERS, Config, Section  # noqa: F401 (re-exported)
from launcher.errors import ConfigError

REQUIRED = object()  # the default of a required key


@dataclass(frozen=True)
class Field:
    """One key as declared (sections.py, a back end's OPTIONS): what the reference, --set and the hash read."""

    kind: str  # int, float, str, bool, mapping, schedule, any, list, section (a nested mapping with its own schema)
    default: Any = REQUIRED
    choices: tuple | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | Any = None
    hint: str = ""
    schema: dict | None = None  # kind "section": the nested keys (a.b.c paths)
    doc: str = ""  # the key's line in the reference (python -m launcher.config.reference)
    train: bool = False  # part of the checkpoint's config hash (launcher/checkpoint/store.py: training_config)
    model: type | None = None  # a mapping-valued key's typed options (checked by them, kept as written)


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
    """The declarations of a section class: ``{key: Field}`` in declaration order."""
    declared = cls.__declared__
    out = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kind, nullable = _kind(declared[f.name])
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
                            schema, meta.get("doc", ""), bool(meta.get("train")), meta.get("model"))
    return out


def _section_class(annotation) -> type:
    """RunConfig of ``RunConfig``, LRSchedulerConfig of ``LRSchedulerConfig | None``."""
    return next(a for a in typing.get_args(annotation) or (annotation,) if a is not type(None))


_CONFIG_HINTS = typing.get_type_hints(Config)
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
_CONFIG = pydantic.TypeAdapter(Config)


def validate(raw: dict) -> Config:
    """Check ``raw`` (parsed YAML) against the typed sections; fill defaults; raise ConfigError naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError("config", f"the file must hold a mapping of sections, got {type(raw).__name__}",
                          "start with e.g. 'task: {target: builtin:regression}'")
    for name in raw:
        if name not in SCHEMA:
            raise ConfigError(str(name), "unknown section", did_you_mean(str(name), SCHEMA))
    given = {}
    for name in SCHEMA:
        value = raw.get(name)
        if value is None and not (name in NULLABLE_SECTIONS and name in raw):
            if name in REQUIRED_SECTIONS:
                raise ConfigError(name, "section is missing", f"add a '{name}:' section")
            value = {}  # absent, or written empty: all defaults
        if value is not None and not isinstance(value, dict):
            raise ConfigError(name, f"expected a mapping, got {value!r}", f"write '{name}: {{key: value}}'")
        given[name] = value
    try:
        cfg = _CONFIG.validate_python(given)
    except pydantic.ValidationError as exc:
        raise config_error(exc, Config) from None
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
    _check_co_scale(cfg)
    _check_schedule_from(cfg)
    _check_invariant_sampler(cfg)
    del schedule
    noise_config.check(cfg)


def _check_co_scale(cfg: Config) -> None:
    """``accumulation.co_scale`` against the other keys (its own keys and rules: sections.CoScaleRules): one LR rule
    (``lr_coupling`` is its alias), and rules the named optimizer can take (an optimizer given by import path is
    checked when the worker builds it)."""
    acc, field = cfg.accumulation, "accumulation.co_scale"
    rules = acc.co_scale or {}
    lr = rules.get("lr", "none")
    if acc.lr_coupling != "none" and lr not in ("none", acc.lr_coupling):
        raise ConfigError(f"{field}.lr", f"is {lr} but accumulation.lr_coupling is {acc.lr_coupling}",
                          "keep one of them (lr_coupling is the same rule under its older name)")
    if rules.get("beta2", "none") != "none" and cfg.optimizer.name == "sgd":
        raise ConfigError(f"{field}.beta2", f"{rules['beta2']} needs an optimizer with betas, and sgd has none",
                          "set beta2: none, or use optimizer.name: adamw")


def _check_schedule_from(cfg: Config) -> None:
    """``accumulation.schedule_from`` against the other keys (its own: sections.ScheduleFromSpec): a rule that
    converts the configured LR scheduler, alone (docs/batch-size.md)."""
    acc, field = cfg.accumulation, "accumulation.schedule_from"
    if acc.schedule_from is None:
        return
    for other in ("schedule", "global_batch", "adaptive"):
        if acc[other] is not None:
            raise ConfigError(field, f"is given together with accumulation.{other}",
                              "keep one: schedule_from derives the schedule from the LR scheduler")
    if acc.lr_coupling != "none" or (acc.co_scale or {}).get("lr", "none") != "none":
        raise ConfigError(field, "sets the LR of every step itself, so an LR rule on top would count the batch twice",
                          "set accumulation.lr_coupling and co_scale.lr to none (beta2 and weight_decay may follow)")
    if acc.unit not in schedule_from.UNITS:
        raise ConfigError("accumulation.unit", f"is {acc.unit}, which schedule_from cannot place factors in",
                          f"use one of {', '.join(schedule_from.UNITS)}")
    if cfg.lr_scheduler is None or (cfg.lr_scheduler.name == "constant"):
        raise ConfigError(field, "has no LR decay to convert (lr_scheduler is null or constant)",
                          "configure the LR scheduler you would decay with, e.g. {name: cosine}")


def _check_invariant_sampler(cfg: Config) -> None:
    """``data.sampler: invariant`` against the other keys: every window's factor must be known before its epoch (an
    epoch-keyed schedule), its back end one that is tested with it, and no short micro-batch is dropped."""
    if cfg.data.sampler != "invariant":
        return
    field, acc = "data.sampler", cfg.accumulation
    if not backends.get(cfg.distributed.backend).invariant_sampler:
        raise ConfigError(field, f"invariant is not supported with distributed.backend {cfg.distributed.backend} "
                          "(tested with ddp, fsdp and one process)", "use distributed.backend: ddp or fsdp, or "
                          "data.sampler: distributed")
    if acc.adaptive is not None or acc.schedule_from is not None or acc.unit != "epoch":
        raise ConfigError(field, "invariant lays out an epoch's windows before it starts, so it needs factors keyed "
                          "by epoch (not adaptive, schedule_from or a step/samples/tokens unit)",
                          "use an epoch-keyed accumulation.schedule or global_batch, or data.sampler: distributed")
    if cfg.data.drop_last:
        raise ConfigError(field, "invariant keeps every sample (a rank's micro-batches may be short or empty), so "
                          "data.drop_last: true has nothing to drop", "set data.drop_last: false")


COMPILE_KEYS = tuple(f.name for f in dataclasses.fields(sections.CompileOptions))
COMPILE_MODES = sections.COMPILE_MODES


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
        _no_repeated_key(node, field)
        size += sum(_expanded_size(k, field, sizes, open_) + _expanded_size(v, field, sizes, open_)
                    for k, v in node.value)
    open_.discard(key)
    if size > MAX_YAML_VALUES:
        raise ConfigError(field, f"the YAML expands to more than {MAX_YAML_VALUES} values through its aliases "
                          "(an alias bomb?)", "write the values out, without nested anchors and aliases (*name)")
    sizes[key] = size
    return size


def _no_repeated_key(node, field: str) -> None:
    """A key written twice in one mapping (``{0: 1, 0: 4}``) is refused: YAML loaders keep the last one silently.
    Keys merged in with ``<<: *alias`` may be overridden, as YAML intends."""
    seen: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        name = (key_node.tag, key_node.value)
        line = key_node.start_mark.line + 1
        if name in seen:
            raise ConfigError(field, f"the key {key_node.value!r} is written twice in one mapping (lines {seen[name]} "
                              f"and {line}), and only one value could count", "keep one of the two lines")
        seen[name] = line


def read_yaml(path: str) -> dict:
    """Safe-load a YAML file; syntax errors become one line with line and column. The file must be UTF-8, hold a
    mapping of sections and stay within MAX_YAML_VALUES once its aliases are expanded."""
    if os.path.isdir(path):
        inside = os.path.join(path, "config.yaml")
        raise ConfigError("config", f"{path!r} is a directory, not a config file",
                          f"give {inside} (a run directory's resolved config)" if os.path.isfile(inside)
                          else "give the path of a YAML file (accum-sched run CONFIG.yaml)")
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


def _override_field(key: str, parts: list[str]) -> Field | None:
    """The declared key ``parts`` reaches (None inside a mapping-valued key: the value is checked where it lands);
    ConfigError for a section, key or nested key that does not exist, or a path through a plain value."""
    section, *rest = parts
    if section not in SCHEMA:
        raise ConfigError(section, "unknown section", did_you_mean(section, SCHEMA))
    if not rest:
        raise ConfigError("--set", f"{key!r} is a section, not a key", f"write e.g. --set {section}."
                          f"{next(iter(SCHEMA[section]))}=VALUE")
    fields, field = SCHEMA[section], None
    for depth, name in enumerate(rest):
        if field is not None and field.kind != "section":
            if field.kind in ("mapping", "any", "schedule") or field.model is not None:
                return None  # task.args.n, accumulation.adaptive.min_factor: inside a mapping
            where = ".".join(parts[:depth + 1])
            raise ConfigError("--set", f"{key!r} goes inside {where}, which holds a {field.kind}, not a mapping",
                              f"write --set {where}=VALUE")
        if field is not None:
            fields = field.schema
        if name not in fields:
            raise ConfigError(".".join(parts[:depth + 2]), "unknown key", did_you_mean(name, fields))
        field = fields[name]
    return field


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides to a copy of ``raw``: any key by its dotted path, one value inside a mapping
    (``task.args.n=200``) too. Values are parsed as YAML, then typed by the schema (a text key keeps the text)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError("--set", f"{item!r} is not key=value", "write e.g. --set optimizer.lr=0.01")
        key, text = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            raise ConfigError("--set", f"{key!r} is not a dotted key path", "write e.g. --set task.args.n=200")
        field = _override_field(key, parts)
        try:
            value = safe_load(text, f"--set {key}") if text.strip() else ""
        except yaml.YAMLError:
            value = text
        on_off = field is not None and isinstance(value, bool) and {"on", "off"} <= set(field.choices or ())
        if field is not None and field.kind == "str" and not isinstance(value, str) and value is not None \
                and not on_off:
            value = text  # typed by the schema: a text key keeps the text as written (YAML's on/off: on/off)
        node = out
        for part in parts[:-1]:  # copies down the path: the caller's raw stays as it was
            inner = node.get(part)
            node[part] = dict(inner) if isinstance(inner, dict) else {}
            node = node[part]
        node[parts[-1]] = value
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
