"""The JSON Schema of a config file, generated from the typed sections (what `accum-sched schema` prints).

Editors that speak JSON Schema (VS Code and others through yaml-language-server) complete keys and check values
with it: every key with its type, choices, bounds, default and its line of the reference as ``description``;
``x-hashed`` marks the keys of the checkpoint's config hash. Torch-free.
"""
from __future__ import annotations

import pydantic

from launcher.config.schema import NULLABLE_SECTIONS, REQUIRED_SECTIONS, SCHEMA
from launcher.config.sections import Config

URL = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict:
    """The schema of a config file: the sections as pydantic validates them, with what validation adds around
    them (a section left out or written empty takes its defaults; only the sections with a required key are
    required)."""
    schema = pydantic.TypeAdapter(Config).json_schema()
    schema["$schema"] = URL
    schema["title"] = "accum-sched config"
    schema["description"] = "A run configuration of accum-sched (docs/cli.md lists every key)."
    properties = schema["properties"]
    for name in SCHEMA:
        section = properties[name]
        ref = {"$ref": section["$ref"]} if "$ref" in section else next(
            s for s in section.get("anyOf", []) if "$ref" in s)
        empty = name not in REQUIRED_SECTIONS or name in NULLABLE_SECTIONS
        properties[name] = {"anyOf": [ref, {"type": "null"}]} if empty else ref
    schema["required"] = [name for name in SCHEMA if name in REQUIRED_SECTIONS]
    return schema
