"""`builtin:stream_lm`: a causal language model trained on a stream of local documents, exactly per token.

Documents: a text file holds one document per non-empty line (the line without its line break; lines of only
whitespace are skipped); a ``.jsonl``/``.json`` file one per non-empty line, the string in its ``text_field`` (a
row whose text is empty is still a document: it adds one EOS). Files are read in the order given (globs sorted).

Tokens: ``tokenizer: bytes`` encodes UTF-8 bytes as ids 0..255, EOS = 256, PAD = 257 (vocabulary 258); a path is
a local Hugging Face tokenizer (a save_pretrained directory, loaded with ``AutoTokenizer.from_pretrained(path,
local_files_only=True)``, or a tokenizer.json loaded with ``tokenizers.Tokenizer.from_file``), documents encoded
without its special tokens; EOS is ``eos_token`` if given, else the tokenizer's own; PAD its pad token, else EOS
(padding is masked, so any id does).

Samples: ``(ids, valid)``: LongTensor[seq_len + 1] and BoolTensor[seq_len + 1] (default_collate stacks them);
``ids[:-1]`` is the input, ``ids[1:]`` the targets, a target counts where ``valid[1:]``. With ``pack: true`` a
stream is ``EOS d0 EOS d1 EOS ... dn EOS`` (each document followed by EOS; one EOS in front so that the first
document's first token is a target too), cut into windows of seq_len + 1 ids that overlap by one: window i holds
tokens ``[i*seq_len, i*seq_len + seq_len]``. Every token of every document and every EOS after one is a target
exactly once; only the stream's final window may be short (padded, masked). With ``pack: false`` each document is
``EOS d EOS`` alone, cut the same way, each piece padded and masked.

Loss: ``loss_fn`` returns the sum of cross-entropy over real targets and their number; the engine divides a window's
gradient by the global count, so a step is the mean over every real token of the window on all ranks.

Sharding, state and resume: see :class:`TokenStream`.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from launcher.errors import ConfigError
from launcher.tasks.builtin import CharTransformer
from launcher.tasks.stream_lm_args import FIELD, is_jsonl, parse

IGNORE = -100
BYTE_EOS, BYTE_PAD, BYTE_VOCAB = 256, 257, 258
STATE_VERSION = 1
# tokens taken as EOS in a bare tokenizer.json (which names no EOS of its own) when eos_token is not given
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|eos|>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


# -- tokenizers -------------------------------------------------------------------------------------------------
class Encoder:
    """``encode(text) -> ids`` (no special tokens), ``eos``, ``pad``, ``vocab_size``."""

    def __init__(self, encode, eos: int, pad: int, vocab_size: int, takes_bytes: bool = False):
        self.encode, self.eos, self.pad, self.vocab_size = encode, eos, pad, vocab_size
        self.takes_bytes = takes_bytes  # encode() takes the raw bytes of a text line (no decoding)


def _bytes_encoder() -> Encoder:
    return Encoder(lambda text: list(text if isinstance(text, bytes) else text.encode("utf-8")), BYTE_EOS, BYTE_PAD,
                   BYTE_VOCAB, takes_bytes=True)


def _tokenizer_error(path: str, exc: Exception) -> ConfigError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{FIELD}.tokenizer", f"cannot load a tokenizer from {path}: {first}",
                       "give a directory written by tokenizer.save_pretrained, a tokenizer.json, or bytes")


def _no_eos(path: str) -> ConfigError:
    return ConfigError(f"{FIELD}.eos_token", f"the tokenizer at {path} names no end-of-document token",
                       "set eos_token to one of its tokens, e.g. eos_token: '</s>'")


def load_encoder(tokenizer: str, eos_token: str | None = None) -> Encoder:
    """The encoder for ``tokenizer`` ("bytes" or an absolute path, as parse() leaves it)."""
    if tokenizer == "bytes":
        return _bytes_encoder()
    if os.path.isfile(tokenizer):
        # optional: only a tokenizer.json file needs it
        from tokenizers import Tokenizer

        try:
            raw = Tokenizer.from_file(tokenizer)
        except Exception as exc:  # tokenizers raises its own Exception subclass for a bad file
            raise _tokenizer_error(tokenizer, exc) from None
        vocab = raw.get_vocab_size(with_added_tokens=True)
        names = (eos_token,) if eos_token is not None else EOS_NAMES
        eos = next((raw.token_to_id(n) for n in names if raw.token_to_id(n) is not None), None)
        if eos is None:
            if eos_token is not None:
                raise ConfigError(f"{FIELD}.eos_token", f"{eos_token!r} is not a token of {tokenizer}",
                                  "name one of its tokens")
            raise _no_eos(tokenizer)
        pad = raw.padding["pad_id"] if raw.padding else next(
            (raw.token_to_id(n) for n in PAD_NAMES if raw.token_to_id(n) is not None), eos)
        return Encoder(lambda text: raw.encode(text, add_special_tokens=False).ids, eos, pad, vocab)
    # optional (accum-sched[hf]): only a Hub tokenizer needs it
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise _tokenizer_error(tokenizer, exc) from None
    if eos_token is not None:
        eos = tok.get_vocab().get(eos_token)
        if eos is None:
            raise ConfigError(f"{FIELD}.eos_token", f"{eos_token!r} is not a token of {tokenizer}",
                              "name one of its tokens, or leave it out to use the tokenizer's eos_token")
    else:
        eos = tok.eos_token_id
        if eos is None:
            raise _no_eos(tokenizer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return Encoder(lambda text: tok.encode(text, add_special_tokens=False), eos, pad, len(tok))


# -- the stream -------------------------------------------------------------------------------------------------
class TokenStream(IterableDataset):
    """Documents of local files as fixed-length samples ``(ids, valid)`` (see the module's doc), one pass per epoch.

    **Sharding**: :meth:`shard` ``(n, i)`` gives a new stream over the documents ``d`` with ``d % n == i`` (``d``
    counts the non-empty lines of all files in order); it reads every line but tokenizes and packs only its own
    documents. A shard of a shard splits it further (``(n1, i1)`` then ``(n2, i2)`` is ``(n1*n2, i1 + n1*i2)``).
    The stream never shards itself by rank or DataLoader worker: the caller does.

    **State**: :meth:`state_dict` is the position after the last sample the current iterator yielded: plain
    ints and one list: ``file`` (index), ``offset`` (byte offset in it of the next unread line), ``line`` (lines
    read of that file, for messages), ``doc`` (documents counted so far, for the shard rule) and ``buffer`` (ids
    read but not yet fully targeted: the packing leftover, or the rest of the current document with ``pack:
    false``; at most seq_len + one document's tokens), plus ``version``, ``shard``, ``seq_len``, ``pack`` to refuse a
    state of another stream. :meth:`load_state_dict` makes the next ``iter()`` start there: it seeks to the offset,
    and nothing before it is read or tokenized again. A later ``iter()`` starts a new pass from the beginning.
    """

    def __init__(self, files, seq_len: int, tokenizer: str = "bytes", pack: bool = True, text_field: str = "text",
                 eos_token: str | None = None, num_shards: int = 1, shard_index: int = 0,
                 encoder: Encoder | None = None):
        super().__init__()
        self.files = tuple(files)
        self.seq_len, self.tokenizer, self.pack = int(seq_len), tokenizer, bool(pack)
        self.text_field, self.eos_token = text_field, eos_token
        self.num_shards, self.shard_index = int(num_shards), int(shard_index)
        self._encoder = encoder
        self._pending: dict | None = None  # a loaded state, for the next iter()
        self._cursor: tuple | None = None  # the live iterator's position: (fields, buffer list, start in it)
        self._live = 0  # which iterator is live (a newer iter() replaces it)
        self.documents_tokenized = 0  # by this object (in this process); for tests and curiosity

    def __getstate__(self):  # to DataLoader workers: the tokenizer is loaded again there, once
        state = dict(self.__dict__)
        state["_encoder"] = None
        return state

    @property
    def encoder(self) -> Encoder:
        if self._encoder is None:
            self._encoder = load_encoder(self.tokenizer, self.eos_token)
        return self._encoder

    def shard(self, num_shards: int, index: int) -> TokenStream:
        """A new stream (from the start) over this one's documents ``j`` (in order) with ``j % num_shards ==
        index``."""
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_shards:
            raise ValueError(f"shard index must be an int in [0, {num_shards}), got {index!r}")
        return TokenStream(self.files, self.seq_len, self.tokenizer, self.pack, self.text_field, self.eos_token,
                           num_shards=self.num_shards * num_shards,
                           shard_index=self.shard_index + self.num_shards * index, encoder=self._encoder)

    # -- state --------------------------------------------------------------------------------------------------
    def _start(self) -> dict:
        return {"version": STATE_VERSION, "shard": [self.num_shards, self.shard_index], "seq_len": self.seq_len,
                "pack": self.pack, "file": 0, "offset": 0, "line": 0, "doc": 0,
                "buffer": [self.encoder.eos] if self.pack else []}

    def state_dict(self) -> dict:
        if self._pending is None and self._cursor is not None:
            fields, buf, pos = self._cursor
            return {**fields, "shard": list(fields["shard"]), "buffer": buf[pos:]}
        state = self._pending or self._start()
        return {**state, "shard": list(state["shard"]), "buffer": list(state["buffer"])}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("version", "shard", "seq_len", "pack", "file", "offset", "line", "doc", "buffer")
                   if k not in state]
        if missing:
            raise ValueError(f"not a TokenStream state: {', '.join(missing)} missing")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"TokenStream state version {state['version']} (this code reads {STATE_VERSION})")
        mine = {"shard": [self.num_shards, self.shard_index], "seq_len": self.seq_len, "pack": self.pack}
        theirs = {"shard": list(state["shard"]), "seq_len": state["seq_len"], "pack": state["pack"]}
        if mine != theirs:
            raise ValueError(f"the state is of another stream ({theirs}; this one is {mine}): load each shard's own "
                             "state into the same shard")
        if not 0 <= int(state["file"]) <= len(self.files):
            raise ValueError(f"the state's file index {state['file']} is outside the {len(self.files)} files")
        self._pending = {**state, "shard": list(state["shard"]), "buffer": [int(t) for t in state["buffer"]]}

    # -- iteration ----------------------------------------------------------------------------------------------
    def __iter__(self):
        start = self._pending if self._pending is not None else self._start()
        self._pending = None
        self._live += 1
        self._cursor = (start, start["buffer"], 0)
        return self._samples(start, self._live)

    def _document(self, raw: bytes, path: str, line: int):
        if not is_jsonl(path):
            text = raw.rstrip(b"\r\n")
            if self.encoder.takes_bytes:
                return text
            try:
                return text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{FIELD}.files", f"line {line} of {path} is not UTF-8 ({exc.reason})",
                                  "re-encode the file as UTF-8") from None
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{FIELD}.files", f"line {line} of {path} is not JSON ({exc})",
                              "write one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get(self.text_field), str):
            raise ConfigError(f"{FIELD}.text_field", f"line {line} of {path} has no text {self.text_field!r}",
                              "give every row that field, or set text_field")
        return row[self.text_field]

    def _sample(self, ids: list[int]):
        n, total = len(ids), self.seq_len + 1
        tokens = torch.full((total,), self.encoder.pad, dtype=torch.long)
        tokens[:n] = torch.tensor(ids, dtype=torch.long)
        return tokens, torch.arange(total) < n

    def _samples(self, state: dict, live: int):
        files, width = self.files, self.seq_len
        fi, offset, line, doc = int(state["file"]), int(state["offset"]), int(state["line"]), int(state["doc"])
        # the ids not yet fully targeted are buf[pos:]; buf is never changed in place once published, so the cursor
        # holds it by reference and state_dict() copies it only when asked (a window costs O(seq_len))
        buf, pos = list(state["buffer"]), 0
        encoder = self.encoder
        n, k = self.num_shards, self.shard_index
        head = {"version": STATE_VERSION, "shard": [n, k], "seq_len": width, "pack": self.pack}

        def publish(fi, offset, line, doc, buf, pos):
            if self._live == live:
                self._cursor = ({**head, "file": fi, "offset": offset, "line": line, "doc": doc}, buf, pos)

        f = None
        try:
            while True:
                # hand out what the buffer holds: full windows (packing), or the current document's pieces
                while len(buf) - pos >= (width + 1 if self.pack else 2):
                    piece, pos = buf[pos:pos + width + 1], pos + width
                    if not self.pack and len(buf) - pos < 2:
                        buf, pos = [], 0  # the overlap token alone has no target left
                    publish(fi, offset, line, doc, buf, pos)
                    yield self._sample(piece)
                # read up to this shard's next document
                text = None
                while text is None and fi < len(files):
                    if f is None:
                        f = open(files[fi], "rb")  # closed below, also when the iterator is abandoned
                        f.seek(offset)
                    raw = f.readline()
                    if not raw:
                        f.close()
                        f, fi, offset, line = None, fi + 1, 0, 0
                        continue
                    offset += len(raw)
                    line += 1
                    if not raw.strip():
                        continue
                    doc += 1
                    if (doc - 1) % n == k:
                        text = self._document(raw, files[fi], line)
                if text is None:
                    break
                ids = encoder.encode(text)
                self.documents_tokenized += 1
                if self.pack:
                    buf, pos = [*buf[pos:], *ids, encoder.eos], 0  # a new list: the published one stays as it was
                else:
                    buf, pos = [encoder.eos, *ids, encoder.eos], 0
            if len(buf) - pos >= 2:  # packing: the final window, short
                publish(fi, 0, 0, doc, [], 0)
                yield self._sample(buf[pos:])
            publish(fi, 0, 0, doc, [], 0)  # the pass is over: a resumed iterator yields nothing more
        finally:
            if f is not None:
                f.close()


# -- model and task ---------------------------------------------------------------------------------------------
class StreamTransformer(CharTransformer):
    """builtin:charlm's transformer, every id a real token (byte 0, a tokenizer's id 0): padding comes only after
    the real tokens of a sample, where the causal mask keeps it out of them, and it is masked from the loss."""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, max_len: int, dropout: float):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len, dropout)
        self.tok = nn.Embedding(vocab_size, d_model)


def loss_fn(model, batch):
    """(sum of cross-entropy over the real next-token targets, their number)."""
    ids, valid = batch
    real = valid[:, 1:]
    logits = model(ids[:, :-1])
    targets = ids[:, 1:].masked_fill(~real, IGNORE)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    return loss, real.sum()


def count_fn(batch) -> int:
    return int(batch[1][:, 1:].sum())


def length_fn(sample) -> int:
    return int(sample[1][1:].sum())


def metrics_fn(model, batch):
    ids, valid = batch
    real = valid[:, 1:]
    correct = (model(ids[:, :-1]).argmax(-1) == ids[:, 1:]) & real
    return {"accuracy": (correct.sum(), real.sum())}


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def stream_lm(files, seq_len: int = 64, tokenizer: str = "bytes", pack: bool = True, d_model: int = 64,
              n_heads: int = 4, n_layers: int = 2, dropout: float = 0.0, val_files=None, text_field: str = "text",
              eos_token: str | None = None, shard_by_rank: bool = False):
    """Next-token prediction over a stream of documents (see the module's doc). ``shard_by_rank``: the stream is
    already this rank's shard (for ``data.shard: none``; leave it false under ``data.shard: auto``, where the
    launcher shards by rank and loader worker)."""
    args = parse({"files": files, "seq_len": seq_len, "tokenizer": tokenizer, "pack": pack, "d_model": d_model,
                  "n_heads": n_heads, "n_layers": n_layers, "dropout": dropout, "val_files": val_files,
                  "text_field": text_field, "eos_token": eos_token, "shard_by_rank": shard_by_rank})
    encoder = load_encoder(args.tokenizer, args.eos_token)

    def stream(paths):
        made = TokenStream(paths, args.seq_len, args.tokenizer, args.pack, args.text_field, args.eos_token,
                           encoder=encoder)
        if args.shard_by_rank:
            rank, world = _rank_world()
            made = made.shard(world, rank)
        return made

    model = StreamTransformer(encoder.vocab_size, args.d_model, args.n_heads, args.n_layers, args.seq_len,
                              args.dropout)
    task = {"model": model, "dataset": stream(args.files), "loss_fn": loss_fn, "count_fn": count_fn,
            "length_fn": length_fn}
    if args.val_files is not None:
        task.update(val_dataset=stream(args.val_files), metrics_fn=metrics_fn)
    return task
