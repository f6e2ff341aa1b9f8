"""The arguments of `builtin:stream_lm`, checked without torch (`accum-sched check` and `run` call `parse` before
launch; the task calls it again in every worker, so a file that vanished in between is still one line).

Paths are relative to the working directory, like every other path of the config; a path with ``*``, ``?`` or
``[`` is a glob (``**`` recurses), expanded in sorted order. Nothing is downloaded: the tokenizer is ``bytes`` or a
local path.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from launcher.errors import ConfigError
from launcher.tasks.args import refuse_unknown

FIELD = "task.args"
JSON_LINES = (".jsonl", ".json")  # one JSON object per line; any other file is text, one document per line
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
ARGS = ("files", "seq_len", "tokenizer", "pack", "d_model", "n_heads", "n_layers", "dropout", "val_files",
        "text_field", "eos_token", "shard_by_rank")


@dataclass(frozen=True)
class StreamArgs:
    files: tuple[str, ...]          # absolute paths, in order (globs expanded, sorted)
    seq_len: int
    tokenizer: str                  # "bytes", or an absolute directory / tokenizer.json path
    pack: bool
    d_model: int
    n_heads: int
    n_layers: int
    dropout: float
    val_files: tuple[str, ...] | None
    text_field: str
    eos_token: str | None
    shard_by_rank: bool


def is_jsonl(path: str) -> bool:
    return path.lower().endswith(JSON_LINES)


def _files(name: str, value, text_field: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"{FIELD}.{name}", f"expected a path or a list of paths, got {value!r}",
                          "write e.g. files: [data/train.txt, data/more.jsonl] or files: 'data/*.txt'")
    out: list[str] = []
    for item in items:
        path = os.path.abspath(os.path.expanduser(item))
        if glob.has_magic(item):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ConfigError(f"{FIELD}.{name}", f"{item!r} matches no file (looked for {path})",
                                  "fix the pattern; paths are relative to where you run accum-sched")
            out.extend(matches)
        elif os.path.isdir(path):
            raise ConfigError(f"{FIELD}.{name}", f"{item!r} is a directory",
                              f"name its files, e.g. {os.path.join(item, '*.txt')!r}")
        elif not os.path.isfile(path):
            raise ConfigError(f"{FIELD}.{name}", f"{item!r} not found (looked at {path})",
                              "give an existing local text or .jsonl file, relative to where you run accum-sched")
        else:
            out.append(path)
    for path in out:
        if is_jsonl(path):
            _check_first_row(name, path, text_field)
    return tuple(out)


def _check_first_row(name: str, path: str, text_field: str) -> None:
    """The first row of a JSON-lines file tells a wrong text_field before anything starts."""
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return  # an empty file holds no documents
    try:
        row = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{FIELD}.{name}", f"the first row of {path} is not JSON ({exc})",
                          "write one JSON object per line (or name the file .txt for plain text)") from None
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        raise ConfigError(f"{FIELD}.text_field", f"{text_field!r} is not a text field of the first row of {path}",
                          f"set text_field to one of {sorted(row) if isinstance(row, dict) else []}")


def _int(args: dict, name: str, default: int, low: int, example: str) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{FIELD}.{name}", f"expected an integer >= {low}, got {value!r}", example)
    return value


def _bool(args: dict, name: str, default: bool) -> bool:
    value = args.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{FIELD}.{name}", f"expected true or false, got {value!r}", f"write {name}: true")
    return value


def _tokenizer(value) -> str:
    if value == "bytes":
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{FIELD}.tokenizer", f"expected 'bytes' or a local tokenizer path, got {value!r}",
                          "write tokenizer: bytes, or the path of a save_pretrained directory or a tokenizer.json")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ConfigError(f"{FIELD}.tokenizer", f"{value!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)})",
                              "give a directory written by tokenizer.save_pretrained, a tokenizer.json, or bytes")
        return path
    if os.path.isfile(path):
        if not path.lower().endswith(".json"):
            raise ConfigError(f"{FIELD}.tokenizer", f"{value!r} is not a tokenizer.json file",
                              "give a tokenizers JSON file, a save_pretrained directory, or bytes")
        return path
    raise ConfigError(f"{FIELD}.tokenizer", f"{value!r} not found (looked at {path})",
                      "write tokenizer: bytes, or an existing local tokenizer path (nothing is downloaded)")


def parse(args: dict) -> StreamArgs:
    """Check ``task.args`` of `builtin:stream_lm`; raise ConfigError naming the argument."""
    refuse_unknown(args, ARGS, "builtin:stream_lm")
    if args.get("files") is None:
        raise ConfigError(f"{FIELD}.files", "is required by builtin:stream_lm",
                          "give a text or .jsonl file, a list of them, or a glob like 'data/*.txt'")
    text_field = args.get("text_field", "text")
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"{FIELD}.text_field", f"expected a field name, got {text_field!r}", "e.g. text")
    seq_len = _int(args, "seq_len", 64, 1, "e.g. seq_len: 64 (tokens per sample, plus one for the last target)")
    d_model = _int(args, "d_model", 64, 1, "e.g. d_model: 64")
    n_heads = _int(args, "n_heads", 4, 1, "e.g. n_heads: 4")
    n_layers = _int(args, "n_layers", 2, 1, "e.g. n_layers: 2")
    if d_model % n_heads:
        raise ConfigError(f"{FIELD}.n_heads", f"d_model {d_model} is not a multiple of n_heads {n_heads}",
                          "pick n_heads dividing d_model")
    dropout = args.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{FIELD}.dropout", f"expected a number in [0, 1), got {dropout!r}", "e.g. 0.1")
    eos_token = args.get("eos_token")
    if eos_token is not None and (not isinstance(eos_token, str) or not eos_token):
        raise ConfigError(f"{FIELD}.eos_token", f"expected a token string, got {eos_token!r}",
                          "e.g. eos_token: '</s>', or leave it out to use the tokenizer's own")
    tokenizer = _tokenizer(args.get("tokenizer", "bytes"))
    if eos_token is not None and tokenizer == "bytes":
        raise ConfigError(f"{FIELD}.eos_token", "is for a tokenizer path; tokenizer: bytes has its own EOS id (256)",
                          "leave eos_token out")
    val = args.get("val_files")
    return StreamArgs(files=_files("files", args["files"], text_field), seq_len=seq_len, tokenizer=tokenizer,
                      pack=_bool(args, "pack", True), d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                      dropout=float(dropout), val_files=None if val is None else _files("val_files", val, text_field),
                      text_field=text_field, eos_token=eos_token, shard_by_rank=_bool(args, "shard_by_rank", False))
