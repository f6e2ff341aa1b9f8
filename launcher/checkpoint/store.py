"""Checkpoints on disk, without torch: names, atomic commits, checksums, discovery, the config hash.

`accum-sched run --resume` uses this before any worker starts (through launcher/checkpoint/resume.py, so a wrong
config or world size is a one-line error with exit 2, and no torch import); the workers' Checkpointer
(launcher/checkpoint/checkpointer.py) uses it to write and find checkpoints. The manifest's fields are
launcher/checkpoint/manifest.py.

A checkpoint is a directory ``<checkpoint.dir>/step-<8-digit optimizer step>/`` holding ``trainer.pt``, the sharded
files of a back end that keeps its own (DeepSpeed's ``deepspeed/``, FSDP2's DCP shards under ``fsdp/``), and
``manifest.json`` (position, world, config hash, back end and the size and sha256 of every file). One taken inside a
window (a preemption) is ``step-NNNNNNNN-mbNNNNNN`` (the micro-batch of the epoch it stopped after) and also holds
``window-rank<R>.pt``, each rank's open window. Files we write are hashed as they are written
(:class:`HashingFile`); only files written by others (DeepSpeed's, DCP's) are read back to hash them. It is built
under ``step-N.tmp`` and renamed into place only when complete, so a directory named ``step-N`` is either complete
or damaged later (truncated, corrupted); a crash mid-write leaves ``.tmp``, which discovery ignores.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from accum_sched.schedule import AccumulationSchedule
from launcher.checkpoint import manifest as manifests
from launcher.checkpoint import pickle_scan
from launcher.checkpoint.manifest import FORMAT, MANIFEST, Manifest, ManifestError
from launcher.config.schema import REQUIRED, key_paths
from launcher.errors import ConfigError

STATE = "trainer.pt"
_NAME = re.compile(r"^step-(\d{8,})(?:-mb(\d{6,}))?$")


def checkpoint_root(cfg) -> str:
    """``checkpoint.dir``, or ``<run.output_dir>/checkpoints``."""
    return cfg.checkpoint.dir or os.path.join(cfg.run.output_dir, "checkpoints")


def step_dir(root: str, step: int, micro_batch: int | None = None) -> str:
    """``step-N``, or ``step-N-mbM`` for a checkpoint taken inside a window, after micro-batch M of its epoch."""
    suffix = "" if micro_batch is None else f"-mb{micro_batch:06d}"
    return os.path.join(root, f"step-{step:08d}{suffix}")


def checkpoint_key(path: str) -> tuple[int, int]:
    """Training order of a checkpoint name: (step, -1 at a boundary, else the micro-batch it stopped after)."""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    if not m:
        return (-1, -1)
    return int(m.group(1)), -1 if m.group(2) is None else int(m.group(2))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoint directories under ``root`` as ``[(step, path)]``, oldest first (valid or not)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if _NAME.match(name) and os.path.isdir(os.path.join(root, name)):
            out.append((checkpoint_key(name), os.path.join(root, name)))
    return [(key[0], path) for key, path in sorted(out)]


# -- writing ----------------------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str) -> str:
    """sha256 of a file; also fsyncs it (files written by others, e.g. DeepSpeed, reach the disk before commit)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())
    return h.hexdigest()


class HashingFile:
    """A file opened for writing that hashes what goes through it: the checkpoint's sha256 costs no second read.

    ``with HashingFile(path) as f: torch.save(state, f)``; then ``f.entry`` is the manifest entry (bytes, sha256).
    Closing flushes and fsyncs."""

    def __init__(self, path: str):
        self._file = open(path, "wb")
        self._hash = hashlib.sha256()
        self._bytes = 0
        self.entry: dict | None = None
        self.failure: OSError | None = None  # a failed write (ENOSPC), which torch.save reports only vaguely

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._bytes += len(view)
        try:
            return self._file.write(view)
        except OSError as exc:
            self.failure = exc
            raise

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self.entry = {"bytes": self._bytes, "sha256": self._hash.hexdigest()}
        finally:
            try:
                self._file.close()
            except OSError:
                if kind is None:
                    raise
        if kind is not None and self.failure is not None and value is not self.failure:
            # torch.save turns a failed write into "[enforce fail at inline_container.cc] unexpected pos": name it
            raise OSError(self.failure.errno, f"{self.failure.strerror} (writing {self._file.name})") from value


def commit(tmp: str, final: str, manifest: Manifest | dict, hashed: dict | None = None) -> None:
    """Write ``tmp``'s manifest and rename it to ``final`` (atomic, never in place). ``hashed`` maps files of tmp
    (relative paths) to entries their writers made while writing (:class:`HashingFile`); every other file is read
    once to hash it (DeepSpeed's own). A dict ``manifest`` (tests write partial ones) is written as given, as the
    current version."""
    files = {}
    hashed = hashed or {}
    for base, _, names in os.walk(tmp):
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, tmp)
            if rel in hashed and hashed[rel]["bytes"] == os.path.getsize(path):
                files[rel] = dict(hashed[rel])
            else:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": file_digest(path)}
    content = manifest.with_files(files).to_dict() if isinstance(manifest, Manifest) else \
        {"version": manifests.VERSION, **manifest, "files": files}
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if os.path.exists(final):  # only a damaged or abandoned one can be in the way: move it aside, keep it
        set_aside(final)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))


def set_aside(path: str, suffix: str = "abandoned") -> str:
    """Rename a checkpoint out of discovery's sight (``step-N.abandoned[.K]``); returns the new name."""
    target, k = f"{path}.{suffix}", 1
    while os.path.exists(target):
        target, k = f"{path}.{suffix}.{k}", k + 1
    os.rename(path, target)
    return target


def supersede(root: str) -> tuple[str, list[str]] | None:
    """A fresh start: move the committed checkpoints under ``root`` into ``root/superseded-<time>/`` (never
    deleted: forgetting --resume must not lose a run). Returns ``(folder, moved paths)``, None if there were none."""
    old = [path for _, path in list_checkpoints(root)]
    if not old:
        return None
    stamp, k = time.strftime("superseded-%Y%m%d-%H%M%S"), 1
    aside = os.path.join(root, stamp)
    while os.path.exists(aside):  # two fresh starts within a second keep both sets
        aside, k = os.path.join(root, f"{stamp}.{k}"), k + 1
    os.makedirs(aside)
    for path in old:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside, old


def unsupersede(root: str, aside: str) -> None:
    """Undo `supersede` (a submission that failed after moving the checkpoints): move them back, drop the folder."""
    for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(root, name))
    os.rmdir(aside)


def rotate(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints; stale ``.tmp`` directories too. Returns what was removed."""
    removed = [path for _, path in list_checkpoints(root)[:-keep]]
    removed += [os.path.join(root, n) for n in os.listdir(root) if n.startswith("step-") and n.endswith(".tmp")]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# -- reading ----------------------------------------------------------------------------------------------------
def verify(path: str, raise_unsafe: bool = False) -> tuple[Manifest | None, str | None]:
    """``(manifest, None)`` if every file of checkpoint ``path`` is present with its recorded size and sha256, and
    our own state files would import nothing unexpected when loaded (pickle_scan.check_state_file), else ``(None,
    problem)``, the problem naming the file at fault (a manifest of another version among them).
    ``raise_unsafe``: raise the state file's UnsafePickle (one line, exit 2 in every command) instead."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None, f"{mpath}: missing (an incomplete checkpoint)"
    except (OSError, ValueError) as exc:
        return None, f"{mpath}: unreadable ({exc})"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or "files" not in raw:
        return None, f"{mpath}: not a format-{FORMAT} accum-sched manifest"
    try:
        manifest = manifests.read(raw)
    except ManifestError as exc:
        return None, f"{mpath}: {exc}"
    for rel, meta in sorted(manifest.files.items()):
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            return None, f"{fpath}: missing"
        size = os.path.getsize(fpath)
        if size != meta["bytes"]:
            return None, f"{fpath}: {size} bytes, the manifest says {meta['bytes']} (truncated or torn)"
        if file_digest(fpath) != meta["sha256"]:
            return None, f"{fpath}: sha256 differs from the manifest (corrupted)"
    for rel in sorted(manifest.files):  # our own state files, one who rewrote the manifest too: checked unread
        if "/" not in rel and rel.endswith(".pt"):
            try:
                pickle_scan.check_state_file(os.path.join(path, rel))
            except pickle_scan.UnsafePickle as exc:
                if raise_unsafe:
                    raise
                return None, str(exc)
    return manifest, None


def find(root: str, resume: str, report=None, exclude: tuple[str, ...] = ()) -> tuple[str, Manifest] | None:
    """The checkpoint to resume from: ``resume`` is ``"auto"`` (the newest valid one under ``root``, falling back
    past damaged ones, each reported by ``report(problem)``, and past those in ``exclude``), a checkpoint directory,
    or a folder of them.

    Returns ``(path, manifest)``, or None when ``auto`` finds no checkpoint at all. Raises ConfigError when an
    explicitly named checkpoint is damaged, or when checkpoints exist but none is valid.
    """
    if resume != "auto":
        path = resume
        if not os.path.exists(path):
            raise ConfigError("--resume", f"{path!r} does not exist",
                              "give a step-NNNNNNNN checkpoint directory, its checkpoints folder, or 'auto'")
        if os.path.isfile(path) and os.path.basename(path) in (MANIFEST, STATE):
            path = os.path.dirname(path) or "."
        if os.path.isfile(os.path.join(path, MANIFEST)) or _NAME.match(os.path.basename(os.path.normpath(path))):
            manifest, problem = verify(path, raise_unsafe=True)  # a planted pickle: the workers' own line, exit 2
            if problem:
                raise ConfigError("--resume", f"checkpoint {problem}",
                                  "pick another checkpoint, or --resume auto for the newest valid one")
            return path, manifest
        if not list_checkpoints(path):
            raise ConfigError("--resume", f"{path!r} is not a checkpoint (no {MANIFEST}) nor a folder of them",
                              "give a step-NNNNNNNN directory, its checkpoints folder, or 'auto'")
        root = path
    entries = list_checkpoints(root)
    for _, path in reversed(entries):
        if path in exclude:  # failed to load on some rank (the workers' fallback): the next newest
            continue
        manifest, problem = verify(path)
        if manifest is not None:
            return path, manifest
        if report is not None:
            report(f"skipping damaged checkpoint: {problem}")
    if entries:
        raise ConfigError("--resume", f"none of the {len(entries)} checkpoints in {root} is intact",
                          "restore one from a backup, or remove the folder to start afresh")
    return None


# -- config identity --------------------------------------------------------------------------------------------
def training_config(cfg) -> dict:
    """The config keys that change what is trained, nested by section: every key marked ``train=True`` in
    launcher/config/sections.py (not where outputs go, how it is logged or how many workers: the world size has its
    own policy, checkpoint.on_world_change), each only where its value differs from its default, so that a key
    added with its default leaves the hash of a checkpoint made before alone. A section written as null is null.
    JSON-normalised; the schedule as its milestones."""
    out: dict = {}
    for path, value in _training_values(cfg).items():
        section = path.split(".")[0]
        if value is _NULL_SECTION:
            out[section] = None
        elif value != _training_defaults()[path]:
            node = out.setdefault(section, {})
            *middle, last = path.split(".")[1:]
            for part in middle:
                node = node.setdefault(part, {})
            node[last] = value
    return out


_NULL_SECTION = object()


def _training_values(cfg) -> dict:
    """``{path: value}`` of every training key of ``cfg``, JSON-normalised; a null section's keys are _NULL_SECTION."""
    d = cfg.to_dict()
    values = {}
    for path, field in key_paths().items():
        if not field.train:
            continue
        section, *parts = path.split(".")
        node = d[section]
        if node is None:
            values[path] = _NULL_SECTION
            continue
        for part in parts:
            node = node[part]
        # the schedule as written (with global_batch the factor depends on the world: not hashed)
        if path == "accumulation.schedule" and node is not None:
            node = [list(m) for m in AccumulationSchedule(node, cfg.accumulation.unit).milestones]
        values[path] = _json(node)
    return values


def _json(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@functools.lru_cache(maxsize=1)
def _training_defaults() -> dict:
    """``{path: default}`` of every training key, JSON-normalised; a required key's is _MISSING (always hashed)."""
    return {path: _MISSING if f.default is REQUIRED else _json(f.default) for path, f in key_paths().items() if f.train}


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(training_config(cfg), sort_keys=True).encode()).hexdigest()


_MISSING = object()


def _recorded(config: dict | None) -> dict:
    """``{path: value}`` of every training key in a manifest's ``config`` (as training_config wrote it, now or in an
    earlier release), defaults filled in for keys it does not hold; a section recorded as null is ``{section:
    None}``. Keys no longer in the schema, or no longer training-relevant, are left out."""
    flat: dict = {}
    for path, default in _training_defaults().items():
        section, *parts = path.split(".")
        node = (config or {}).get(section, {})
        if node is None:
            flat[section] = None
            continue
        for part in parts:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        flat[path] = (None if default is _MISSING else default) if node is _MISSING else node
    return flat


def config_differences(manifest: Manifest | dict, cfg) -> list[tuple[str, object, object]]:
    """``[(field, value in the checkpoint, value now)]`` for training fields that differ; empty if none.

    A key the checkpoint does not record (at its default then, or added to the schema since) counts as its
    default; a section null on one side only is one difference, named by the section."""
    manifest = manifest.to_dict() if isinstance(manifest, Manifest) else manifest  # or its JSON object
    if manifest.get("config_hash") == config_hash(cfg):
        return []
    old, new = _recorded(manifest.get("config")), _recorded(training_config(cfg))
    diffs = []
    for section in sorted(k for k in old.keys() | new.keys() if "." not in k):  # null on at least one side
        was, now = _section(old, section), _section(new, section)
        if was != now:
            diffs.append((section, was, now))
    for k in sorted(old.keys() & new.keys()):  # both sides' sections are present
        if "." in k and old[k] != new[k]:
            diffs.append((k, old[k], new[k]))
    return sorted(diffs, key=lambda d: d[0])


def _section(flat: dict, section: str):
    """None for a section recorded as null, else its training keys ``{key: value}`` (nested keys by their path)."""
    if section in flat:
        return flat[section]
    return {k[len(section) + 1:]: v for k, v in flat.items() if k.startswith(section + ".")}


# -- metrics ----------------------------------------------------------------------------------------------------
REWOUND = "metrics.rewound.jsonl"  # lines a resume (or a fresh start) cut from metrics.jsonl, kept, never deleted


@dataclass(frozen=True)
class MetricsRewind:
    """What :func:`rewind_metrics` did to metrics.jsonl: lines kept, lines moved to :data:`REWOUND`, whether one of
    them was torn (not JSON: a worker stopped mid-write), the last step kept (0: none), whether there was a file."""

    kept: int = 0
    aside: int = 0
    torn: bool = False
    last_step: int = 0
    existed: bool = False  # none: a resume into another directory (accum-sched cbs's branches), nothing to miss

    def notes(self, run_dir: str, step: int) -> list[str]:
        """Warnings for the log: lines set aside, a torn line, and steps before ``step`` that have no line."""
        out = []
        aside = os.path.join(run_dir, REWOUND)
        if self.torn:
            out.append(f"warning: metrics.jsonl: a torn line (a worker stopped mid-write) was found and moved to "
                       f"{aside}")
        if self.aside - self.torn:
            out.append(f"metrics.jsonl: {self.aside - self.torn} line(s) after step {step} (a future this resume "
                       f"rewinds) moved to {aside}")
        if self.existed and self.last_step < step:
            missing = f"{self.last_step + 1}-{step}" if step > self.last_step + 1 else f"{step}"
            out.append(f"warning: metrics.jsonl has no line for step(s) {missing}, trained before this checkpoint "
                       "(lost with a torn or deleted file): they stay missing; `accum-sched report` names the gap")
        return out


def rewind_metrics(run_dir: str, step: int) -> MetricsRewind:
    """Keep the metrics.jsonl lines of optimizer steps <= ``step`` (a resumed run rewrites the rest, so none is
    duplicated); the others, and any line that is not JSON (torn), are appended to :data:`REWOUND` first. Atomic."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return MetricsRewind()
    kept, aside, torn, last = [], [], False, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line if line.endswith("\n") else line + "\n"
            try:
                record = json.loads(line)
                at = int(record.get("step", 0)) if isinstance(record, dict) else None
            except (ValueError, TypeError):
                at = None
            if at is None:
                torn = torn or bool(line.strip())
                aside += [line] if line.strip() else []
            elif at <= step:
                kept.append(line)
                last = max(last, at)
            else:
                aside.append(line)
    if aside:
        with open(os.path.join(run_dir, REWOUND), "a", encoding="utf-8") as f:
            f.writelines(aside)
            f.flush()
            os.fsync(f.fileno())
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return MetricsRewind(len(kept), len(aside), torn, last, existed=True)


def truncate_metrics(run_dir: str, step: int) -> int:
    """:func:`rewind_metrics`, returning the lines kept."""
    return rewind_metrics(run_dir, step).kept
