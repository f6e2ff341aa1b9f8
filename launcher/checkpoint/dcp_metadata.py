"""Check DCP's ``.metadata`` before torch reads it. torch.distributed.checkpoint's FileSystemReader loads that file
with a plain ``pickle.load`` (torch/distributed/checkpoint/filesystem.py: read_metadata): whoever can write a
checkpoint could make a resume import and call anything. The checksums of manifest.json do not help against one who
rewrites the manifest too.

So every ``.metadata`` under a checkpoint is first unpickled here by an Unpickler that resolves only what DCP's
metadata is made of (:func:`_allowed`: the classes of torch.distributed.checkpoint.metadata, the file system
reader's _StorageInfo, torch.Size, dtypes, layouts and memory formats, pathlib paths); any other import refuses the
file with :class:`UnsafeMetadata`, one line naming the file and the import, before anything of it ran. The torch
zip files we write ourselves are loaded with ``weights_only=True`` instead (launcher/checkpoint/checkpointer.py).
"""
from __future__ import annotations

import importlib
import os
import pickle

import torch

from launcher.checkpoint.pickle_scan import UnsafePickle

METADATA = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
FIX = "resume from an earlier checkpoint (--resume PATH), or start afresh without --resume"


class UnsafeMetadata(UnsafePickle):
    """A DCP .metadata that would import something DCP's metadata never holds (the worker prints it as one line,
    as for DeepSpeed's files: launcher/worker.py)."""


def _allowed(module: str, name: str):
    """The object ``module.name`` if DCP metadata may hold it, else None."""
    if module == _METADATA_MODULE:
        obj = getattr(importlib.import_module(module), name, None)
        return obj if isinstance(obj, type) and obj.__module__ == module else None
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or (module, name) in _ALLOWED:
            return obj
        return None
    if (module, name) in _ALLOWED:
        return getattr(importlib.import_module(module), name)
    return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeMetadata(f"would import {module}.{name}")
        return obj


def check(path: str) -> None:
    """Raise :class:`UnsafeMetadata` unless ``path`` unpickles from DCP metadata's own classes alone."""
    try:
        with open(path, "rb") as f:
            _Unpickler(f).load()
    except UnsafeMetadata as exc:
        raise UnsafeMetadata(f"{path}: {exc} when unpickled, which DCP metadata never does: refused, nothing of it "
                             f"was run; {FIX}") from None
    except Exception as exc:  # noqa: BLE001 -- truncated, not a pickle: torch would fail on it too, less clearly
        first = (str(exc).splitlines() or [""])[0]
        raise UnsafeMetadata(f"{path}: not readable DCP metadata ({type(exc).__name__}: {first}); {FIX}") from None


def check_tree(root: str) -> None:
    """:func:`check` every ``.metadata`` under checkpoint directory ``root``."""
    for base, _, names in os.walk(root):
        if METADATA in names:
            check(os.path.join(base, METADATA))
