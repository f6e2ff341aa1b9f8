"""Check a torch file's pickles before something loads it without ``weights_only``. Standard library only.

DeepSpeed's ``load_checkpoint`` reads its own shards with ``torch.load(weights_only=False)``: any pickle there may
import and call anything. Before the DeepSpeed back end hands it a checkpoint, every file of the checkpoint is read
here without being unpickled: each pickle's opcodes (``pickletools.genops``) are walked, and every object the
pickle would import (GLOBAL, STACK_GLOBAL, INST) must be on :data:`ALLOWED`, the names a DeepSpeed checkpoint of
this project holds (tensors and their storages, dtypes, ``collections.OrderedDict``, a few of DeepSpeed's own data
classes, numpy's array rebuild). Anything else, an import whose name cannot be read off the opcodes, an extension
code, a file that is not a torch zip archive: :class:`UnsafePickle`, one line naming the file and the import.
Nothing of the file is executed.
"""
from __future__ import annotations

import io
import os
import pickletools
import zipfile

from launcher.errors import CheckpointError

TORCH_DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64", "complex128", "uint8",
    "int8", "int16", "short", "int32", "int", "int64", "long", "bool", "float8_e4m3fn", "float8_e5m2"})
# (module, name) pairs, and modules whose every name of a given kind is allowed (see _allowed)
ALLOWED = frozenset({
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("builtins", "object"), ("builtins", "dict"), ("builtins", "list"), ("builtins", "int"),
    ("builtins", "float"), ("builtins", "str"), ("builtins", "tuple"),
    ("copyreg", "_reconstructor"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),  # Tensor: ZeRO-3 optimizer shards
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._utils", "_rebuild_sparse_tensor"), ("torch._utils", "_rebuild_qtensor"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "ndarray"),
    ("numpy", "dtype"),
    # DeepSpeed's own values in its checkpoints (0.19: the ZeRO stage, a parameter's place in the flat buffer,
    # the loss scaler's settings)
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
})
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"})


class UnsafePickle(CheckpointError):
    """A file of a checkpoint would import something a checkpoint has no business importing."""


def refusal(path: str, what: str) -> UnsafePickle:
    """The one line every load path (`run` before launch and in the workers, `cbs --from`) gives for a state file
    of ours that must not be loaded: the same words whoever finds it."""
    return UnsafePickle(f"{path}: cannot be loaded ({what}); nothing of it was run: resume from an earlier checkpoint "
                        "(--resume PATH), or start afresh without --resume")


def check_state_file(path: str) -> None:
    """Raise :func:`refusal` when ``path`` (trainer.pt, window-rank<R>.pt, stream-rank<R>.pt: files we wrote with
    torch.save) would import what :data:`ALLOWED` does not name, or is a pickle outside a torch zip archive (a raw
    pickle, or torch's legacy format, which we never write). Read, never unpickled: torch.load(weights_only=True)
    stays the loader, this makes its refusal one line before anything is moved or launched. Bytes that are neither
    an archive nor a pickle (a torn archive, something else) are left to torch.load, which names what is wrong."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if _starts_a_pickle(head):
            raise refusal(path, "not a torch zip archive: a legacy-format file or a raw pickle, never written by "
                                "accum-sched, is not unpickled")
        return
    for _, data in _pickles(path):
        try:
            found = imports(data)
        except ValueError as exc:
            raise refusal(path, f"its pickle {exc}") from None
        for item in found:
            if item is None or not _allowed(*item):
                what = "an import whose name is computed" if item is None else f"{item[0]}.{item[1]}"
                raise refusal(path, f"it would import {what}, refused by weights_only")


def _starts_a_pickle(head: bytes) -> bool:
    """``head`` opens with a pickle of protocol 2 or later (PROTO, then opcodes to STOP, or 16 and more of them
    where the pickle is longer than ``head``), as a raw pickle and torch's legacy format (its magic number first)
    do; random bytes almost never parse that far."""
    if len(head) < 3 or head[0] != 0x80 or head[1] not in (2, 3, 4, 5):
        return False
    read = 0
    try:
        for op, _, _ in pickletools.genops(io.BytesIO(head)):
            if op.name == "STOP":
                return True
            read += 1
    except Exception:  # noqa: BLE001 -- bytes genops cannot read: not a pickle, or one longer than ``head``
        return read >= 16  # a long pickle cut off by ``head``: 16 valid opcodes in a row are no accident
    return False


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED:
        return True
    if module == "torch" and (name in TORCH_DTYPES or (name.endswith("Storage") and name.isidentifier())):
        return True  # dtypes; the typed storages of the zip format's persistent ids (FloatStorage, ...)
    if module.startswith(("numpy.dtypes", "numpy.core.numeric", "numpy._core.numeric")) and name.endswith("DType"):
        return True
    return False


def imports(data: bytes) -> list[tuple[str, str] | None]:
    """Every (module, name) the pickle(s) in ``data`` would import, in order; None for one whose name the opcodes
    do not spell out (a STACK_GLOBAL of values that are not plain strings). Raises ValueError for an opcode that
    imports through the extension registry, or for bytes that are not a pickle."""
    found: list[tuple[str, str] | None] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        strings: list = []  # what was pushed recently, strings as themselves and anything else as None
        memo: dict = {}
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append((module, attr))
                strings.append(None)
            elif name == "STACK_GLOBAL":
                pair = strings[-2:]
                found.append(tuple(pair) if len(pair) == 2 and None not in pair else None)
                strings.append(None)
            elif name in ("EXT1", "EXT2", "EXT4"):
                raise ValueError(f"imports through the extension registry (opcode {name})")
            elif name in _STRING_OPS:
                strings.append(arg if isinstance(arg, str) else arg.decode("latin-1"))
            elif name in ("MEMOIZE",):
                memo[len(memo)] = strings[-1] if strings else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = strings[-1] if strings else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(arg))
            elif name == "STOP":
                break
            elif op.stack_after or op.stack_before:
                strings.append(None)
    return found


def _pickles(path: str) -> list[tuple[str, bytes]]:
    """(label, bytes) of every pickle in torch file ``path`` (a zip archive: its ``.pkl`` members)."""
    if not zipfile.is_zipfile(path):
        raise UnsafePickle(f"{path}: not a torch zip archive, cannot be checked before loading; refusing it "
                           f"(remove the checkpoint, or resume from another one)")
    with zipfile.ZipFile(path) as archive:
        return [(f"{path}:{member}", archive.read(member)) for member in archive.namelist()
                if member.endswith(".pkl")]


def check_file(path: str) -> None:
    """Raise UnsafePickle (one line, naming the file and the import) unless every import of ``path`` is allowed."""
    for label, data in _pickles(path):
        try:
            found = imports(data)
        except ValueError as exc:
            raise UnsafePickle(f"{label}: {exc}; refusing to load it (remove the checkpoint, or resume from "
                               f"another one)") from None
        for item in found:
            if item is None or not _allowed(*item):
                what = "an import whose name is computed" if item is None else f"{item[0]}.{item[1]}"
                raise UnsafePickle(f"{label}: would import {what}, which no checkpoint of this project holds; "
                                   f"refusing to load it (nothing of it was run; remove the checkpoint, or resume "
                                   f"from another one)")


def check_tree(directory: str) -> int:
    """:func:`check_file` for every file under ``directory`` that torch could load (``.pt``, ``.pth``, ``.bin``,
    ``.pkl``, or any zip archive); returns how many were checked."""
    checked = 0
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith((".pt", ".pth", ".bin", ".pkl")) or zipfile.is_zipfile(path):
                check_file(path)
                checked += 1
    return checked
