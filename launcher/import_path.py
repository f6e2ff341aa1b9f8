"""Objects named by import path in the config: ``torch.optim.RMSprop`` or ``mypkg.optim:Lion``.

Torch-free: `check` runs before launch (login nodes) and only asks the import system whether the top-level package
exists (``find_spec`` of a top-level name imports nothing); `load` imports at worker start. Both raise one-line
ConfigErrors naming the config field.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

from launcher.errors import ConfigError

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_PATH = re.compile(rf"^{_DOTTED}(:{_DOTTED}|\.[A-Za-z_][A-Za-z0-9_]*)$")


def looks_like_path(text: str) -> bool:
    """``a.b.C`` or ``a.b:C`` (a bare word is a built-in name, not a path)."""
    return bool(_PATH.match(text)) and ("." in text or ":" in text)


def ensure_cwd_on_path() -> None:
    """Put the working directory on sys.path: `accum-sched run` is started from the user's project, and their task,
    optimizer and scheduler modules live there (as with ``python -m``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def split(text: str) -> tuple[str, str]:
    """``(module, attribute path)``: after ':' when there is one, else the last dotted part."""
    if ":" in text:
        module, _, attr = text.partition(":")
        return module, attr
    module, _, attr = text.rpartition(".")
    return module, attr


def check(field: str, text: str, what: str) -> None:
    """Before launch: the top-level package of ``text`` must be installed or importable from the current directory."""
    if not looks_like_path(text):
        raise ConfigError(field, f"{text!r} is not an import path",
                          f"write e.g. 'torch.optim.RMSprop' or 'mypkg.mod:{what}'")
    top = split(text)[0].split(".")[0]
    ensure_cwd_on_path()
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(field, f"cannot import {text!r}: no module named {top!r}",
                          "install the package or run from the directory that contains it")


def load(field: str, text: str):
    """Import the object ``text`` names (at worker start); ConfigError if the module or the attribute is missing."""
    module_name, attr = split(text)
    ensure_cwd_on_path()
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, f"cannot import {text!r}: {exc}",
                          "check the module path (write 'package.module:Name' or 'package.module.Name')") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(field, f"cannot import {text!r}: module {module_name!r} has no {attr!r}",
                              "check the name after the module") from None
    return obj
