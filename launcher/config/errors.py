"""pydantic's ValidationError as the launcher's one-line ConfigError: the key's dotted path, what is wrong with the
value, how to fix it (the key's declared hint, the known keys or choices with a did-you-mean). Torch-free."""
from __future__ import annotations

import dataclasses
import difflib
import typing

import pydantic

from launcher.errors import ConfigError
from launcher.options import config_name

_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "dict": "a mapping",
          "list": "a list", "NoneType": "null"}
_FIXES = {"int": "write a whole number", "float": "write e.g. 0.001", "bool": "write true or false",
          "str": "quote the value", "dict": "write key: value pairs, e.g. {a: 1}", "list": "write e.g. [0.9, 0.999]"}
_TYPE_ERRORS = {"int_type": "int", "int_parsing": "int", "int_from_float": "int", "float_type": "float",
                "float_parsing": "float", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str",
                "dict_type": "dict", "dataclass_type": "dict", "list_type": "list"}


def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    known = ", ".join(map(str, options))
    return f"did you mean {close[0]!r}? (known: {known})" if close else f"known keys: {known}"


def _members(annotation) -> list[str]:
    """The type names a declared annotation allows (``bool | dict`` -> ["bool", "dict"]), None left out."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, type(int | None)) else ()
    if args:
        return [n for a in args for n in _members(a)]
    base = typing.get_origin(annotation) or annotation
    name = getattr(base, "__name__", str(base))
    return [] if name == "NoneType" else [name]


def _is_tag(part) -> bool:
    """A union member's tag in a pydantic loc (``bool``, ``function-after[run(), dict[any,any]]``), not a key."""
    return not isinstance(part, str) or "[" in part or part in _TYPES


def _walk(loc: tuple, owner: type) -> tuple[list[str], type, str | None, dict]:
    """The key names ``loc`` passes through (union tags and list indexes dropped), the class that declares the last
    one, that key's name and its declaration metadata. A mapping-valued key's options are walked into."""
    path, name, meta, inside, holder = [], None, {}, False, owner
    for part in loc:
        fields = {config_name(f): f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if not isinstance(part, str) or part not in fields:
            if inside and _is_tag(part):
                continue  # the mapping member of a union (run.compile: bool or its options)
            if isinstance(part, str) and fields and not _is_tag(part):
                path.append(part)  # an unknown key: named as written
                name, meta, holder = part, {}, owner
            break
        path.append(part)
        # name: the attribute (``async_`` of ``async``), which the class's hints and declarations are keyed by
        name, meta, inside, holder = fields[part].name, dict(fields[part].metadata), False, owner
        factory = fields[part].default_factory
        if meta.get("model") is not None:
            owner, inside = meta["model"], True
        elif isinstance(factory, type) and dataclasses.is_dataclass(factory):
            owner = factory
        else:
            hints = typing.get_type_hints(owner)
            nested = [a for a in typing.get_args(hints[name]) or (hints[name],) if dataclasses.is_dataclass(a)]
            if not nested:
                break
            owner = nested[0]
    return path, holder, name, meta


def _pick(errors: list[dict]) -> dict:
    """The error to report: an unknown key first, then one that says more than "not this member of the union"."""
    for wanted in (lambda t: t in ("unexpected_keyword_argument", "extra_forbidden"),
                   lambda t: t not in _TYPE_ERRORS and t != "none_required"):
        for err in errors:
            if wanted(err["type"]):
                return err
    return errors[0]


def config_error(exc: pydantic.ValidationError, root: type) -> ConfigError:
    """The first error of ``exc`` (validating ``root``, the Config) as a ConfigError."""
    err = _pick(exc.errors(include_url=False))
    path, owner, name, meta = _walk(err["loc"], root)
    field = ".".join(path) or "config"
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    declared = getattr(owner, "__declared__", {}).get(name) or typing.get_type_hints(owner).get(name) \
        if name and dataclasses.is_dataclass(owner) else None
    hint = meta.get("hint", "")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        known = [config_name(f) for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
        return ConfigError(field, "unknown key", did_you_mean(str(name), known))
    if kind == "missing":
        section = ".".join(path[:-1])
        return ConfigError(field, "is required", hint or f"add '{name}:' under '{section}:'")
    if kind == "check":
        where = f"{field}.{ctx['field']}" if ctx.get("field") else field
        return ConfigError(where, ctx["problem"], ctx.get("hint") or hint or "change the value")
    if kind == "literal_error":
        choices = [c.strip("'") for c in ctx.get("expected", "").replace(" or ", ", ").split(", ")]
        fix = did_you_mean(str(value), choices).replace("known keys", "known values") if isinstance(value, str) \
            else hint or f"write one of {', '.join(choices)}"
        return ConfigError(field, f"{value!r} is not one of {', '.join(choices)}", fix)
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than": ("<", "lt"),
              "less_than_equal": ("<=", "le")}
    if kind in bounds:
        op, bound = bounds[kind]
        return ConfigError(field, f"must be {op} {ctx[bound]}, got {value!r}", hint or "change the value")
    if kind == "string_too_short":
        return ConfigError(field, f"expected a non-empty string, got {value!r}", hint or "write the value")
    if kind in _TYPE_ERRORS and value is None:
        return ConfigError(field, "must not be null", hint or "give a value, or remove the key for its default")
    if kind in _TYPE_ERRORS:
        members = _members(declared) if declared is not None else []
        if len(members) < 2:
            members = [_TYPE_ERRORS[kind]]
        wanted = " or ".join(dict.fromkeys(_TYPES.get(m, m) for m in members))
        return ConfigError(field, f"expected {wanted}, got {value!r}", hint or _FIXES.get(members[0], "change it"))
    return ConfigError(field, f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}", hint or "change the value")
