"""The arguments of `builtin:hf_causal_lm`, checked without torch or transformers (`accum-sched check` and `run`
call `parse` before launch; the workers call it again, so a path that vanished in between is still one line).

Paths are taken relative to the working directory, like every other path of the config. Nothing is ever
downloaded: a model, tokenizer or data set is a local path, or the model is an inline config.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from launcher.errors import ConfigError
from launcher.tasks.args import refuse_unknown

FIELD = "task.args"
# what `save_pretrained` / `save_to_disk` leave in a directory, to tell a model directory and a data set apart
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
JSON_LINES = (".jsonl", ".json")


@dataclass(frozen=True)
class HFArgs:
    model: str | dict          # an absolute directory, or an inline config mapping with model_type
    tokenizer: str | None      # an absolute directory, or None for byte-level ids
    data: str                  # an absolute file or save_to_disk directory
    max_length: int
    val_fraction: float
    text_field: str

    @property
    def model_dir(self) -> str | None:
        return self.model if isinstance(self.model, str) else None

    @property
    def has_weights(self) -> bool:
        return self.model_dir is not None and any(
            os.path.isfile(os.path.join(self.model_dir, f)) for f in WEIGHT_FILES)

    @property
    def data_kind(self) -> str:
        """``datasets`` (a save_to_disk directory), ``jsonl`` or ``text``."""
        if os.path.isdir(self.data):
            return "datasets"
        return "jsonl" if self.data.lower().endswith(JSON_LINES) else "text"


def _path(name: str, value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{FIELD}.{name}", f"expected the path of {what}, got {value!r}",
                          "write a local path (nothing is downloaded)")
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.exists(path):
        raise ConfigError(f"{FIELD}.{name}", f"{value!r} not found (looked at {path})",
                          "give an existing local path, relative to where you run accum-sched (nothing is "
                          "downloaded)")
    return path


def _model(value) -> str | dict:
    if isinstance(value, dict):
        if not isinstance(value.get("model_type"), str):
            raise ConfigError(f"{FIELD}.model.model_type", "is missing from the inline model config",
                              "write e.g. model: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2}")
        return dict(value)
    path = _path("model", value, "a model directory (config.json, weights optional) or an inline config mapping")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"{FIELD}.model", f"{value!r} has no config.json",
                          "give a directory written by save_pretrained, or an inline mapping with model_type")
    try:
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"{FIELD}.model", f"{config} is not a JSON object ({exc})", "fix or rewrite it") from None
    if not isinstance(model_type, str):
        raise ConfigError(f"{FIELD}.model", f"{config} names no model_type", "add \"model_type\": \"gpt2\" (or yours)")
    return path


def _tokenizer(value, model) -> str | None:
    if value is None:  # the model directory's tokenizer when it has one, else byte-level ids
        if isinstance(model, str) and any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
            return model
        return None
    path = _path("tokenizer", value, "a tokenizer directory")
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"{FIELD}.tokenizer", f"{value!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)})",
                          "give a directory written by tokenizer.save_pretrained, or leave it out for byte-level ids")
    return path


def _data(value, text_field: str) -> str:
    path = _path("data", value, "a text file, a JSON-lines file or a datasets save_to_disk directory")
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in DATASET_FILES):
            raise ConfigError(f"{FIELD}.data", f"directory {value!r} was not written by datasets' save_to_disk",
                              "give a text file (one sample per line), a .jsonl file or a save_to_disk directory")
    elif path.lower().endswith(JSON_LINES):  # the first row tells a wrong text_field before anything starts
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        if first is None:
            raise ConfigError(f"{FIELD}.data", f"{value!r} is empty", "give a file with one JSON object per line")
        try:
            row = json.loads(first)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{FIELD}.data", f"{value!r} line 1 is not JSON ({exc.msg})",
                              "write one JSON object per line") from None
        if not isinstance(row, dict) or text_field not in row:
            raise ConfigError(f"{FIELD}.text_field", f"{text_field!r} is not a field of {value!r} line 1",
                              f"set text_field to one of {sorted(row) if isinstance(row, dict) else []}")
    return path


ARGS = ("model", "tokenizer", "data", "max_length", "val_fraction", "text_field")


def parse(args: dict) -> HFArgs:
    """Check ``task.args`` of `builtin:hf_causal_lm`; raise ConfigError naming the argument."""
    refuse_unknown(args, ARGS, "builtin:hf_causal_lm")
    for key in ("model", "data"):
        if args.get(key) is None:
            raise ConfigError(f"{FIELD}.{key}", "is required by builtin:hf_causal_lm",
                              "give a local path (model may also be an inline config with model_type)")
    max_length = args.get("max_length", 128)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"{FIELD}.max_length", f"expected an integer >= 2, got {max_length!r}", "e.g. 128")
    val_fraction = args.get("val_fraction", 0.0)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"{FIELD}.val_fraction", f"expected a number in [0, 1), got {val_fraction!r}",
                          "e.g. 0.1 to hold out a tenth of the samples")
    text_field = args.get("text_field", "text")
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"{FIELD}.text_field", f"expected a field name, got {text_field!r}", "e.g. text")
    model = _model(args["model"])
    return HFArgs(model=model, tokenizer=_tokenizer(args.get("tokenizer"), model),
                  data=_data(args["data"], text_field), max_length=max_length, val_fraction=float(val_fraction),
                  text_field=text_field)
