"""`builtin:stream_lm`: documents of local files packed into fixed windows, sharded by document, resumed in O(1),
and trained exactly per token.

The expected tokens come from an independent reading of the corpus here (bytes split at newlines, JSON rows parsed),
so each check compares the stream with what it must hold: packing targets every token of every document and every
EOS exactly once, in order, padding only the final window; ``pack: false`` pads and masks each document's pieces;
shards partition the documents; a resume from ``state_dict()`` (plain, and through torchdata's StatefulDataLoader
with 0 and 2 workers) continues exactly, without reading the bytes before the saved offset; the engine at factor 3
over the stream (partial last window, short last micro-batch, a padded last sample) equals a plain-torch reference
that steps once per window on the mean over the window's real target tokens, in one process and on 2 ranks.
"""
from __future__ import annotations

import copy
import json
import os
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from distributed import spawn
from launcher import tasks
from launcher.errors import ConfigError
from launcher.tasks import stream_lm as stream_lm_module
from launcher.tasks import stream_lm_args
from launcher.tasks.stream_lm import BYTE_EOS, BYTE_PAD, TokenStream, loss_fn, stream_lm

SEQ, MICRO = 8, 3
WORDS = ["the", "stream", "packs", "documents", "into", "windows", "naïve", "straße", "日本語", "token", "a", "of",
         "every", "rank", "reads", "its", "own", "shard", "x"]



def write_corpus(folder) -> list[str]:
    """Three files (text, JSON lines, text with CRLF and blank lines): ~70 documents of 0 to ~400 bytes."""
    rnd = random.Random(0)

    def line(most=12):
        return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, most)))

    a = []
    for i in range(30):
        a.append(line())
        if i % 7 == 3:
            a.append("")  # blank
        if i % 11 == 5:
            a.append("   \t")  # whitespace only: no document
    a.insert(9, line(80))  # longer than several windows
    b = [json.dumps({"id": i, "text": line(8) if i != 4 else ""}, ensure_ascii=i % 2 == 0) for i in range(14)]
    c = [line() for _ in range(12)]
    c.insert(3, "")
    paths = [os.path.join(folder, n) for n in ("a.txt", "b.jsonl", "c.txt")]
    with open(paths[0], "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(a) + "\n")
    with open(paths[1], "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(b) + "\n\n")
    with open(paths[2], "w", encoding="utf-8", newline="") as f:
        f.write("\r\n".join(c))  # CRLF, no line break at the end
    return paths


def documents(paths) -> list[bytes]:
    """The documents as UTF-8 bytes, read independently of the stream."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            for raw in f.read().split(b"\n"):
                if not raw.strip():
                    continue
                out.append(json.loads(raw)["text"].encode() if path.endswith(".jsonl") else raw.rstrip(b"\r"))
    return out


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


def stream(paths, **kwargs) -> TokenStream:
    return stream_lm(paths, seq_len=kwargs.pop("seq_len", SEQ), d_model=16, n_heads=2, n_layers=1, **kwargs)["dataset"]


def targets(samples) -> list[int]:
    """Every real target of the samples, in order."""
    return [t for ids, valid in samples for t in ids[1:][valid[1:]].tolist()]


def as_lists(samples):
    return [(ids.tolist(), valid.tolist()) for ids, valid in samples]


# -- packing, pack: false, shards --------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [(1, 0), (3, 1)])
def test_packing_targets_every_token_once_and_pads_only_the_last_window(corpus, shards):
    n, i = shards
    samples = list(stream(corpus).shard(n, i))
    mine = documents(corpus)[i::n]
    expected = [t for doc in mine for t in [*doc, BYTE_EOS]]
    assert targets(samples) == expected  # each token of each document and each EOS a target once, in order
    assert len(targets(samples)) == sum(len(d) + 1 for d in mine)
    assert samples[0][0][0] == BYTE_EOS  # the stream's first document is predicted from an EOS in front
    for (ids, valid), (after, _) in zip(samples, samples[1:]):
        assert valid.all(), "padding before the final window"
        assert ids[-1] == after[0]  # windows overlap by one token
    ids, valid = samples[-1]
    real = int(valid.sum())
    assert 2 <= real < SEQ + 1 and valid[:real].all() and not valid[real:].any()  # this corpus ends short
    assert (ids[real:] == BYTE_PAD).all()
    assert all(ids.shape == (SEQ + 1,) and ids.dtype == torch.long and valid.dtype == torch.bool
               for ids, valid in samples)


def test_unpacked_documents_are_padded_and_masked_each_alone(corpus):
    samples = list(stream(corpus, pack=False))
    expected = []
    for doc in documents(corpus):
        seq = [BYTE_EOS, *doc, BYTE_EOS]
        for start in range(0, len(seq) - 1, SEQ):
            piece = seq[start:start + SEQ + 1]
            expected.append((piece + [BYTE_PAD] * (SEQ + 1 - len(piece)), [True] * len(piece) +
                             [False] * (SEQ + 1 - len(piece))))
    assert as_lists(samples) == expected
    assert sum(not v.all() for _, v in samples) > 20  # most documents end in a padded piece
    assert sum(1 for ids, _ in samples if ids[0] != BYTE_EOS) > 10  # longer documents go on in more pieces


@pytest.mark.parametrize("pack", [True, False])
def test_shards_are_disjoint_and_cover_every_document(corpus, pack):
    docs = documents(corpus)
    base = stream(corpus, pack=pack)
    for n in (2, 3, len(docs) + 2):  # the last leaves shards with no document: they yield nothing
        seen = []
        for i in range(n):
            shard = base.shard(n, i)
            got = bytes(t if t < 256 else 10 for t in targets(list(shard))).split(b"\n")[:-1]  # split at EOS
            assert got == docs[i::n], (n, i)
            assert shard.documents_tokenized == len(docs[i::n])  # it tokenized its own documents only
            seen += got
        assert sorted(seen) == sorted(docs)
    # a shard of a shard splits it further: (2, 1) then (3, 2) is (6, 1 + 2 * 2)
    assert as_lists(base.shard(2, 1).shard(3, 2)) == as_lists(base.shard(6, 5))
    with pytest.raises(ValueError, match="shard index"):
        base.shard(2, 2)


# -- state and resume --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pack", [True, False])
def test_resume_from_state_dict_equals_an_uninterrupted_pass(corpus, pack):
    full = as_lists(stream(corpus, pack=pack).shard(2, 1))
    for k in (0, 1, 7, len(full) // 2, len(full) - 1, len(full)):
        first = stream(corpus, pack=pack).shard(2, 1)
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))  # plain ints and lists
        assert len(state["buffer"]) <= SEQ + 1 + 400
        resumed = stream(corpus, pack=pack).shard(2, 1)
        resumed.load_state_dict(state)
        assert as_lists(head) + as_lists(resumed) == full, k
        assert as_lists(resumed) == full  # the pass after the resumed one starts from the beginning
        assert as_lists(head) + as_lists(it) == full  # taking the state did not disturb the iterator
        assert first.state_dict()["file"] == len(corpus) and first.state_dict()["buffer"] == []  # pass over
    with pytest.raises(ValueError, match="another stream"):
        stream(corpus, pack=pack).shard(2, 0).load_state_dict(state)  # shard 1's state into shard 0


class ReadLog:
    """Stands in for ``open`` in the task's module: records, per file, the positions reads start at."""

    def __init__(self):
        self.reads: dict[str, list[int]] = {}

    def __call__(self, path, *args, **kwargs):
        log, f = self.reads.setdefault(os.fspath(path), []), open(path, *args, **kwargs)

        class Logged:
            def __getattr__(self, name):
                return getattr(f, name)

            def __iter__(self):
                return self

            def __next__(self):
                log.append(f.tell())
                return next(f)

            def read(self, *a):
                log.append(f.tell())
                return f.read(*a)

            def readline(self, *a):
                log.append(f.tell())
                return f.readline(*a)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Logged()


def test_resume_reads_nothing_before_the_saved_offset(corpus, monkeypatch):
    full = as_lists(stream(corpus).shard(3, 1))
    own_documents = len(documents(corpus)[1::3])
    first = stream(corpus).shard(3, 1)
    it = iter(first)
    head = []
    while not (first.state_dict()["file"] == 1 and first.state_dict()["offset"] > 0 and len(head) > 3):
        head.append(next(it))  # into the middle of the JSON-lines file
    state = first.state_dict()
    tokenized_before = first.documents_tokenized
    resumed = stream(corpus).shard(3, 1)  # built first: the task's argument check reads each JSON file's first row
    # what lies before the saved position is destroyed: a resume that read it (to skip or recount) would differ
    with open(corpus[0], "wb") as f:
        f.write(b"gone\n" * 3)
    with open(corpus[1], "r+b") as f:
        f.write(b"{not json" + b"z" * (state["offset"] - 10) + b"\n")
    resumed.load_state_dict(state)
    reads = ReadLog()
    monkeypatch.setattr(stream_lm_module, "open", reads, raising=False)
    assert as_lists(head) + as_lists(resumed) == full
    assert corpus[0] not in reads.reads and min(reads.reads[corpus[1]]) == state["offset"], reads.reads
    assert min(reads.reads[corpus[2]]) == 0  # the next file from its start
    assert resumed.documents_tokenized == own_documents - tokenized_before  # none tokenized twice


class PerWorker(IterableDataset):
    """What the launcher does under ``data.shard: auto``: in each loader worker (or the main process with no
    workers) the stream's shard ``rank * workers + id`` of ``world * workers``; the loader's state calls go to it."""

    def __init__(self, base: TokenStream, world: int = 1, rank: int = 0):
        self.base, self.world, self.rank, self._inner = base, world, rank, None

    def __getstate__(self):
        return {**self.__dict__, "_inner": None}

    def _shard(self) -> TokenStream:
        if self._inner is None:
            info = get_worker_info()
            workers, index = (info.num_workers, info.id) if info is not None else (1, 0)
            self._inner = self.base.shard(self.world * workers, self.rank * workers + index)
        return self._inner

    def __iter__(self):
        return iter(self._shard())

    def state_dict(self):
        return self._shard().state_dict()

    def load_state_dict(self, state):
        self._shard().load_state_dict(state)


def _batches(loader, count=None):
    out = []
    for batch in loader:
        out.append([t.clone() for t in batch])
        if count is not None and len(out) == count:
            break
    return out


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resume_equals_an_uninterrupted_pass(corpus, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(PerWorker(stream(corpus), world=2, rank=1), batch_size=3, num_workers=workers)

    full = _batches(loader())
    samples = sorted(map(str, as_lists(s for ids, valid in full for s in zip(ids, valid))))
    shards = [stream(corpus).shard(2 * max(workers, 1), i + max(workers, 1)) for i in range(max(workers, 1))]
    assert samples == sorted(map(str, as_lists(s for shard in shards for s in shard)))  # rank 1's, once each
    for k in (1, len(full) // 2, len(full)):
        first = loader()
        head = _batches(first, k)
        state = first.state_dict()
        second = loader()
        second.load_state_dict(state)
        rest = _batches(second)
        got = head + rest
        assert len(got) == len(full) and all(torch.equal(g, f) for a, b in zip(got, full) for g, f in zip(a, b)), k
        assert len(_batches(second)) == len(full)  # then a new epoch from the start


# -- exact normalisation with the engine ------------------------------------------------------------------------
def _task(corpus, pack=True):
    torch.manual_seed(0)
    return stream_lm(corpus, seq_len=SEQ, d_model=16, n_heads=2, n_layers=1, pack=pack)


def _token_losses(model, ids, valid):
    """Cross-entropy of each real next-token target (written here, not the task's loss_fn)."""
    logits = model(ids[:, :-1])
    losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return losses[valid[:, 1:]]


def _reference(model, per_rank: list[list], factor: int, epochs: int, wrong: bool = False):
    """One optimizer step per window on every rank's micro-batches of that window as one batch: the sum of token
    losses over the window's real targets divided by their number (``wrong``: the mean of micro-batch means)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    n = min(len(b) for b in per_rank)  # a stream's epoch ends where the shortest rank's ends
    for _ in range(epochs):
        for start in range(0, n, factor):
            window = [b for batches in per_rank for b in batches[start:min(start + factor, n)]]
            if wrong:
                loss = sum(_token_losses(model, *b).mean() for b in window) / len(window)
            else:
                loss = _token_losses(model, torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window]))
                loss = loss.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


def _train(model, loader, epochs: int):
    from accum_sched import AccumulationEngine

    engine = AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uneven streams: truncated at the shortest (said on rank 0)
        for epoch in range(epochs):
            engine.train_epoch(loader, loss_fn, epoch)
    return engine


def _close(got, want) -> bool:
    return all(torch.allclose(g, w, atol=1e-6, rtol=1e-5) for g, w in zip(got.parameters(), want.parameters()))


@pytest.mark.parametrize("pack", [True, False])
def test_engine_normalises_over_the_real_tokens_of_each_window(corpus, pack):
    task = _task(corpus, pack)
    model, start = task["model"], copy.deepcopy(task["model"])
    loader = DataLoader(task["dataset"], batch_size=MICRO)
    batches = _batches(loader)
    # what makes the check sharp: a partial last window, a short last micro-batch, a padded last sample (packed:
    # the last window has 2 micro-batches, so a mean of micro-batch means is off there; unpacked: everywhere)
    assert len(batches) % 3 and not batches[-1][1].all()
    assert not pack or (len(batches) % 3 == 2 and len(batches[-1][0]) < MICRO)
    engine = _train(model, loader, epochs=2)
    assert engine.optimizer_steps == 2 * -(-len(batches) // 3)
    assert _close(model, _reference(copy.deepcopy(start), [batches], 3, epochs=2))
    assert not _close(model, _reference(copy.deepcopy(start), [batches], 3, epochs=2, wrong=True))


def _ranks(rank: int, world: int, corpus: list[str], out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    task = _task(corpus)
    loader = DataLoader(task["dataset"].shard(world, rank), batch_size=MICRO)
    _train(DDP(task["model"]), loader, epochs=1)
    torch.save([p.detach() for p in task["model"].parameters()], os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_engine_on_two_ranks_each_on_its_shard_equals_the_reference(corpus, tmp_path):
    spawn(_ranks, 2, corpus, str(tmp_path), deadline_s=120)
    task = _task(corpus)
    per_rank = [_batches(DataLoader(task["dataset"].shard(2, r), batch_size=MICRO)) for r in range(2)]
    assert min(map(len, per_rank)) % 3  # a partial last window
    reference = _reference(task["model"], per_rank, 3, epochs=1)
    for rank in range(2):
        got = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        for g, w in zip(got, reference.parameters(), strict=True):
            torch.testing.assert_close(g, w.detach(), atol=1e-6, rtol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")


# -- Hugging Face tokenizers ------------------------------------------------------------------------------------
def _word_tokenizer(corpus, special=("[PAD]", "[UNK]", "[EOS]")):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([d.decode() for d in documents(corpus)],
                            trainers.WordLevelTrainer(special_tokens=list(special)))
    return raw


def test_hf_tokenizer_file_and_directory(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    raw = _word_tokenizer(corpus)
    raw.save(str(tmp_path / "tokenizer.json"))
    eos, pad = raw.token_to_id("[EOS]"), raw.token_to_id("[PAD]")
    expected = [t for doc in documents(corpus) for t in [*raw.encode(doc.decode()).ids, eos]]
    from_file = list(stream(corpus, tokenizer=str(tmp_path / "tokenizer.json")))
    assert targets(from_file) == expected and from_file[0][0][0] == eos
    assert (from_file[-1][0][~from_file[-1][1]] == pad).all() and not from_file[-1][1].all()
    task = stream_lm(corpus, seq_len=SEQ, tokenizer=str(tmp_path / "tokenizer.json"), d_model=16, n_heads=2)
    assert task["model"].head.out_features == raw.get_vocab_size()

    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="[EOS]", pad_token="[PAD]").save_pretrained(
        tmp_path / "tok")
    from_dir = list(stream(corpus, tokenizer=str(tmp_path / "tok")))
    assert as_lists(from_dir) == as_lists(from_file)
    # eos_token names another token; a tokenizer without one is a one-line error naming the argument
    unk = raw.token_to_id("[UNK]")
    assert targets(stream(corpus, tokenizer=str(tmp_path / "tok"), eos_token="[UNK]")) == [
        t for doc in documents(corpus) for t in [*raw.encode(doc.decode()).ids, unk]]
    bare = _word_tokenizer(corpus, special=("[UNK]",))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ConfigError, match=r"^task\.args\.eos_token: .*set eos_token"):
        stream(corpus, tokenizer=str(tmp_path / "bare.json"))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^task\.args\.tokenizer: cannot load"):
        stream(corpus, tokenizer=str(tmp_path / "broken.json"))


# -- arguments ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, field, says", [
    ({"files": "missing.txt"}, "files", "not found"),
    ({"files": "nothing-*.txt"}, "files", "matches no file"),
    ({"files": "."}, "files", "is a directory"),
    ({"files": "a.txt", "seq_len": 0}, "seq_len", "integer >= 1"),
    ({"files": "a.txt", "pack": "yes"}, "pack", "true or false"),
    ({"files": "a.txt", "tokenizer": "no/such/tokenizer"}, "tokenizer", "not found"),
    ({"files": "a.txt", "tokenizer": "."}, "tokenizer", "holds no tokenizer"),
    ({"files": "b.jsonl", "text_field": "body"}, "text_field", "not a text field"),
    ({"files": "a.txt", "seq_length": 8}, "seq_length", "did you mean 'seq_len'"),
    ({"files": "a.txt", "d_model": 10, "n_heads": 4}, "n_heads", "not a multiple"),
    ({"seq_len": 8}, "files", "is required"),
])
def test_bad_arguments_are_one_line_naming_the_argument(corpus, monkeypatch, args, field, says):
    monkeypatch.chdir(os.path.dirname(corpus[0]))  # relative paths are relative to the working directory
    with pytest.raises(ConfigError) as caught:
        tasks.check_args("builtin:stream_lm", args)  # before launch, without torch
    line = str(caught.value)
    assert line.startswith(f"task.args.{field}: ") and says in line and "\n" not in line and "; " in line, line
    if "files" in args and set(args) <= set(stream_lm_args.ARGS):
        with pytest.raises(ConfigError, match=f"^task\\.args\\.{field}: "):
            stream_lm(**args)  # the workers' own check


def test_globs_relative_paths_and_validation_files(corpus, monkeypatch):
    monkeypatch.chdir(os.path.dirname(corpus[0]))
    assert tasks.resolve("builtin:stream_lm") == ("launcher.tasks.stream_lm", "stream_lm")
    task = tasks.build("builtin:stream_lm", {"files": "*.txt", "seq_len": SEQ, "val_files": ["b.jsonl"],
                                             "d_model": 16, "n_heads": 2})
    assert task.dataset.files == (corpus[0], corpus[2])  # sorted, absolute
    assert isinstance(task.val_dataset, TokenStream) and task.val_dataset.files == (corpus[1],)
    sample = next(iter(task.dataset))
    assert task.length_fn(sample) == SEQ and task.count_fn([t[None] for t in sample]) == SEQ
    assert set(task.metrics_fn(task.model, next(iter(DataLoader(task.val_dataset, batch_size=2))))) == {"accuracy"}
