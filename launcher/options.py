"""How a config section is declared: :func:`key` for each key, :func:`section` to make the class a frozen pydantic
dataclass, :class:`Section` for the read-only mapping API.

A leaf of the launcher (pydantic and the standard library only, no torch): launcher/config declares the shared
sections with it, and each back end in launcher/backends declares its own options with it, so neither has to import
the other for a declaration.

:func:`section` turns each key's declaration into the pydantic type that validates it: the annotation made strict
(YAML's ``true`` is not the integer 1, ``"16"`` is not a number of samples), ``choices`` a ``Literal``, ``check`` a
constraint (``at_least(1)`` is JSON Schema's ``minimum``) or a validator, ``model`` the typed options a mapping-valued
key holds. The declaration's ``doc`` and ``train`` go into the JSON Schema (``description``, ``x-hashed``) and into
the dataclass field's metadata, where the reference in docs/cli.md and the checkpoint's config hash read them.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import annotated_types
import pydantic
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Strict, TypeAdapter, WithJsonSchema
from pydantic_core import PydanticCustomError

MODEL_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)  # frozen: by each dataclass decorator


def key(default: Any = dataclasses.MISSING, *, doc: str, train: bool, choices: tuple | None = None, check=None,
        hint: str = "", kind: str | None = None, model: type | None = None, name: str | None = None):
    """A config key. ``default`` omitted: required. ``train``: the key is part of the checkpoint's config hash.
    ``check``: a constraint (:func:`at_least`, :func:`positive`) or ``check(value)`` returning a problem ("must be
    >= 1, got 0") or None; ``hint``: the error line's how-to-fix; ``kind`` "schedule": plain YAML data checked later
    with its unit; ``model``: the options type (an :func:`options` dataclass) a mapping-valued key is checked
    against; the value stays the mapping as written (what the config hash and config.yaml hold). ``name``: the key's
    name in the config where it is a Python keyword (``checkpoint.async``, declared as ``async_``)."""
    meta = {"doc": doc, "train": train, "choices": choices, "check": check, "hint": hint, "kind": kind,
            "model": model, "name": name}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    if isinstance(default, type):  # a nested section: its own defaults
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# -- checks -----------------------------------------------------------------------------------------------------
def at_least(low):
    return annotated_types.Ge(low)


positive = annotated_types.Gt(0)


class Section(Mapping):
    """A read-only config section: ``section.key``, ``section["key"]``, ``section.get(key)``, ``to_dict()``."""

    SECTION: ClassVar[str] = ""  # the path of the section in the config ("distributed.fsdp")

    def __getattr__(self, name):  # only reached for keys the dataclass does not have
        if name.startswith("__"):
            raise AttributeError(name)
        declared = {config_name(f): f.name for f in dataclasses.fields(self)}
        if name in declared and declared[name] != name:  # getattr(section, "async")
            return getattr(self, declared[name])
        raise AttributeError(f"config section {self.SECTION!r} has no key {name!r}")

    def __getitem__(self, name):
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def keys(self):
        return [config_name(f) for f in dataclasses.fields(self)]

    def to_dict(self) -> dict:
        """Plain data, nested sections included (what config.yaml holds)."""
        return {k: (v.to_dict() if isinstance(v, Section) else v) for k, v in ((k, getattr(self, k)) for k in self)}


def config_name(field: dataclasses.Field) -> str:
    """A key's name in the config: its attribute's, unless declared with another (a Python keyword: ``async``)."""
    return field.metadata.get("name") or field.name


# -- strict scalar types: what YAML gives, without pydantic's lax conversions -----------------------------------
def _number(value):
    """A float key takes ints and floats, and numeric text (YAML 1.1 reads ``1e-3`` as a string); never a bool."""
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "expected a number")
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise PydanticCustomError("float_type", "expected a number") from None
    return value


def _text(value):
    """A free-text key takes a number as its text (``--set run.output_dir=123`` is the directory "123")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _on_off(value):
    """YAML reads ``on``/``off``/``true``/``false`` unquoted as booleans: for an auto/on/off key they mean on/off."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def _schedule_value(value):
    """A schedule stays plain YAML data ({int: int}, a string or an int; JSON's "0" keys made ints), checked with
    its unit later (launcher/config/sections.py: Config.schedule_for)."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.strip().isdigit() else k): v for k, v in value.items()}
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    raise PydanticCustomError("schedule_type", "expected a mapping {epoch: factor}, a string like '0:1,5:2' or an int")


Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, BeforeValidator(_number)]
Str = Annotated[str, Strict()]
Text = Annotated[str, Strict(), BeforeValidator(_text)]
_SCALARS = {int: Int, bool: Bool, float: Float, str: Str}


def _strict(annotation):
    """``annotation`` with every scalar made strict (inside lists and unions too)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if origin is Annotated:
        return Annotated[_strict(args[0]), *annotation.__metadata__]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, (_strict(a) for a in args))
    if origin is list and args:
        return list[_strict(args[0])]
    return annotation


def _checked(check):
    def run(value):
        problem = check(value)
        if problem:
            raise PydanticCustomError("check", "{problem}", {"problem": problem})
        return value
    return AfterValidator(run)


class _SchemaOf:
    """JSON Schema of a key as that of ``annotation`` (a mapping-valued key's options), built only when a schema is
    asked for (`accum-sched schema`), not each time the config is imported."""

    def __init__(self, annotation):
        self.annotation = annotation

    def __get_pydantic_json_schema__(self, core_schema, handler):
        return TypeAdapter(self.annotation).json_schema()


def options_of(model: type):
    """A validator keeping a mapping as written once ``model`` accepts it (its errors nested under the key)."""
    adapter = []  # built on first use: importing the config stays cheap

    def run(value):
        if not adapter:
            adapter.append(TypeAdapter(model))
        adapter[0].validate_python(value)  # its errors join the config's, under the key's path
        return value
    return AfterValidator(run)


def _declared_type(meta: dict, annotation):
    """The pydantic type of one key from its annotation and declaration (see the module's docstring)."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    rest = [a for a in members if a is not type(None)]
    nullable = len(rest) < len(members)
    base = functools.reduce(lambda a, b: a | b, rest)
    extras: list = []
    if meta.get("kind") == "schedule":
        typed = Annotated[Any, BeforeValidator(_schedule_value), _SchemaOf(dict[int, int] | str | int)]
    elif meta.get("choices") is not None:
        typed = Literal[tuple(meta["choices"])]
        if {"on", "off"} <= set(meta["choices"]):  # editors accept YAML's booleans there too
            extras += [BeforeValidator(_on_off), WithJsonSchema(
                {"anyOf": [{"enum": list(meta["choices"]), "type": "string"}, {"type": "boolean"}]})]
    elif base is str:
        typed = Text
    elif meta.get("model") is not None:
        model = meta["model"]
        mapping = Annotated[dict, options_of(model), _SchemaOf(model)]
        typed = functools.reduce(lambda a, b: a | b, [mapping if a is dict else _strict(a) for a in rest])
    else:
        typed = _strict(base)
    described = pydantic.Field(description=meta.get("doc"), json_schema_extra={"x-hashed": bool(meta.get("train"))},
                               alias=meta.get("name"))
    check = meta.get("check")
    if isinstance(check, annotated_types.BaseMetadata):
        extras.append(check)
    elif check is not None:
        extras.append(_checked(check))
    typed = Annotated[typed, *extras] if extras else typed
    return Annotated[typed | None if nullable else typed, described]


def section(cls=None, *, path: str = ""):
    """Make ``cls`` (annotated keys declared with :func:`key`) a frozen pydantic dataclass of typed keys."""
    def wrap(cls):
        if path:
            cls.SECTION = path
        hints = typing.get_type_hints(cls, include_extras=True)
        annotations = {}
        for name in cls.__dict__.get("__annotations__", {}):
            value = cls.__dict__.get(name)
            hint = hints[name]
            if typing.get_origin(hint) is ClassVar:
                annotations[name] = hint
                continue
            meta = value.metadata if isinstance(value, dataclasses.Field) else {}
            annotations[name] = _declared_type(meta, hint) if meta else hint
        cls.__annotations__ = annotations
        cls.__declared__ = {name: hints[name] for name in annotations}  # as written: the reference's kinds
        return pydantic.dataclasses.dataclass(frozen=True, eq=False, kw_only=True, config=MODEL_CONFIG)(cls)
    return wrap if cls is None else wrap(cls)


def options(cls):
    """The typed options of a mapping-valued key (``accumulation.adaptive``): plain annotated defaults, no marks."""
    hints = typing.get_type_hints(cls, include_extras=True)
    cls.__annotations__ = {name: _strict(hints[name]) for name in cls.__dict__.get("__annotations__", {})}
    return pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=MODEL_CONFIG)(cls)
