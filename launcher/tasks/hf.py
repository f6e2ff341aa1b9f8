"""`builtin:hf_causal_lm`: a Hugging Face causal language model trained on local text, exactly per token.

The model is a local `save_pretrained` directory (with weights, or config.json alone for a fresh init) or an inline
config (`model_type` + fields); text comes from a text file (one sample per line), a JSON-lines file or a `datasets`
save_to_disk directory; the tokenizer is a local directory, or byte-level ids (0..255) when there is none. Each
sample is tokenized once and cut into pieces of at most ``max_length`` tokens.

Exactness: batches are right-padded; ``labels`` are the input ids with -100 on padding, and the loss shifts them by
one (token t predicts t+1), so ``loss_fn`` returns the sum of cross-entropy over real next-token targets and their
number. The engine divides the window's gradient by the global count: the mean over every real token of the window
on all ranks, however the tokens fall into micro-batches (Hugging Face's own loss would average per micro-batch).

The model is returned as it is (no wrapper module), so FSDP's auto wrap finds its ``_no_split_modules`` and
DeepSpeed sees the Hugging Face module. ``save_fn`` writes ``output_dir/hf`` with ``save_pretrained`` from the final
consolidated state dict, so it works the same under DDP, DeepSpeed (every ZeRO stage) and FSDP.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import torch
import torch.nn.functional as F

from launcher.errors import ConfigError
from launcher.tasks.hf_args import FIELD, HFArgs, parse

IGNORE = -100  # label of a position that is not a target (padding); the value Hugging Face models use too
BYTE_VOCAB = 256
SPLIT_SEED = 0  # the train/validation split is the same on every rank and every run


def _quiet_transformers() -> None:
    # progress bars and info lines from every rank would bury the training progress
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# -- model ------------------------------------------------------------------------------------------------------
def _load_model(args: HFArgs):
    # optional (accum-sched[hf]), and slow to import: only this task needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if args.has_weights:
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        else:
            if args.model_dir is not None:
                config = AutoConfig.from_pretrained(args.model_dir)
            else:
                fields = dict(args.model)
                config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            # fresh weights from the run seed (set before the task is built): identical on every rank
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{FIELD}.model", f"transformers cannot build a causal LM from it: {first}",
                          "check model_type and the config fields (AutoModelForCausalLM must know the type)") from None
    model.train()  # from_pretrained leaves the model in eval mode (dropout off)
    return model


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# -- text -------------------------------------------------------------------------------------------------------
def _read_texts(args: HFArgs) -> list[str]:
    field = args.text_field
    if args.data_kind == "text":
        with open(args.data, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    if args.data_kind == "jsonl":
        texts = []
        with open(args.data, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{FIELD}.data", f"line {number} of {args.data} is not JSON ({exc.msg})",
                                      "write one JSON object per line") from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ConfigError(f"{FIELD}.text_field", f"line {number} of {args.data} has no text {field!r}",
                                      "give every row that field, or set text_field")
                texts.append(row[field])
        return texts
    # optional (accum-sched[hf]): only a Hub or local dataset needs it
    import datasets

    loaded = datasets.load_from_disk(args.data)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"{FIELD}.data", f"the DatasetDict has no 'train' split (splits: {list(loaded)})",
                              "save the training split alone, or name it 'train'")
        loaded = loaded["train"]
    if field not in loaded.column_names:
        raise ConfigError(f"{FIELD}.text_field", f"{field!r} is not a column of {args.data}",
                          f"set text_field to one of {loaded.column_names}")
    return [t for t in loaded[field] if isinstance(t, str) and t.strip()]


def _encoder(args: HFArgs):
    """(texts -> lists of ids, padding id, tokenizer or None)."""
    if args.tokenizer is None:
        return (lambda texts: [list(t.encode("utf-8")) for t in texts]), 0, None
    # optional (accum-sched[hf]): only a named tokenizer needs it
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{FIELD}.tokenizer", f"transformers cannot load it: {str(exc).splitlines()[0]}",
                          "give a directory written by tokenizer.save_pretrained") from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked anyway; any valid id
    return (lambda texts: tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]), pad, tokenizer


def _samples(ids_per_text: list[list[int]], max_length: int) -> list[torch.Tensor]:
    """Each text cut into consecutive pieces of at most ``max_length`` ids; a piece needs 2 ids to hold a target."""
    out = []
    for ids in ids_per_text:
        for start in range(0, len(ids), max_length):
            piece = ids[start:start + max_length]
            if len(piece) >= 2:
                out.append(torch.tensor(piece, dtype=torch.long))
    return out


def _split(samples: list, fraction: float) -> tuple[list, list | None]:
    if fraction == 0:
        return samples, None
    order = list(range(len(samples)))
    random.Random(SPLIT_SEED).shuffle(order)
    n_val = max(1, round(len(samples) * fraction))
    if n_val >= len(samples):
        raise ConfigError(f"{FIELD}.val_fraction", f"{fraction} of {len(samples)} samples leaves none to train on",
                          "lower val_fraction or give more data")
    held = set(order[:n_val])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


# -- batches and loss -------------------------------------------------------------------------------------------
def make_collate(pad_id: int):
    def collate(samples):
        """Right padding: real tokens keep positions 0..n-1, as when each sample runs alone."""
        if isinstance(samples[0], dict):
            samples = [s["input_ids"] for s in samples]
        length = max(len(s) for s in samples)
        input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, ids in enumerate(samples):
            input_ids[row, :len(ids)] = ids
            attention_mask[row, :len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    return collate


def loss_fn(model, batch):
    """(sum of next-token cross-entropy over real targets, their number): labels shifted by one, -100 ignored."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    logits = logits[:, :-1].float()  # fp32 loss under bf16 autocast
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                               reduction="sum")
    return loss_sum, (targets != IGNORE).sum()


def count_fn(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


# -- output -----------------------------------------------------------------------------------------------------
def make_save_fn(config, tokenizer):
    def save_fn(state_dict: dict, output_dir: str) -> None:
        """``output_dir/hf``: config + safetensors (+ tokenizer), from the final consolidated fp32 state dict.

        A fresh module on the meta device takes the tensors (no second copy of the weights, and none of the
        training wrappers: DDP, ZeRO partitions, FSDP shards), so the export is the same under every back end.
        """
        # optional (accum-sched[hf]), as in _load_model
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(state_dict, assign=True, strict=True)
        fresh.tie_weights()  # assign=True replaced tied parameters by separate tensors; share them again
        target = os.path.join(output_dir, "hf")
        tmp = f"{target}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        fresh.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # a rerun replaces the previous export as a whole
        os.replace(tmp, target)

    return save_fn


def hf_causal_lm(**raw):
    """Build the task from ``task.args`` (see launcher/tasks/hf_args.py for the arguments and their checks)."""
    args = parse(raw)
    _quiet_transformers()
    model = _load_model(args)
    encode, pad_id, tokenizer = _encoder(args)
    positions = _max_positions(model.config)
    if positions is not None and args.max_length > positions:
        raise ConfigError(f"{FIELD}.max_length", f"{args.max_length} exceeds the model's {positions} positions",
                          f"set max_length <= {positions}")
    samples = _samples(encode(_read_texts(args)), args.max_length)
    if not samples:
        raise ConfigError(f"{FIELD}.data", f"{args.data} yields no sample of 2 or more tokens",
                          "give non-empty text")
    vocab = model.get_input_embeddings().num_embeddings
    top = max(int(s.max()) for s in samples)
    if top >= vocab:
        source = "byte-level ids need vocab_size >= 256" if tokenizer is None else "the tokenizer is larger"
        raise ConfigError(f"{FIELD}.model", f"token id {top} is outside the model's vocabulary of {vocab} ({source})",
                          "raise vocab_size in the model config, or use the model's own tokenizer")
    train, val = _split(samples, args.val_fraction)
    return {"model": model, "dataset": train, "val_dataset": val, "loss_fn": loss_fn,
            "collate_fn": make_collate(pad_id), "count_fn": count_fn,
            "save_fn": make_save_fn(model.config, tokenizer)}
