"""Checkpoints on disk, without torch: names, manifests, checksums, discovery, the config hash, world-size policy.

`accum-sched run --resume` uses this before any worker starts (so a wrong config or world size is a one-line error
with exit 2, and no torch import); the workers' Checkpointer (launcher/checkpoint/checkpointer.py) uses it to write and find
checkpoints.

A checkpoint is a directory ``<checkpoint.dir>/step-<8-digit optimizer step>/`` holding ``trainer.pt`` and, for
DeepSpeed, the engine's own ``deepspeed/`` files, plus ``manifest.json`` (position, world, config hash and the
size and sha256 of every file). One taken inside a window (a preemption) is ``step-NNNNNNNN-mbNNNNNN`` (the
micro-batch of the epoch it stopped after) and also holds ``window-rank<R>.pt``, each rank's open window. Files we
write are hashed as they are written (:class:`HashingFile`); only files written by others (DeepSpeed's) are read
back to hash them. It is built under ``step-N.tmp`` and renamed into place only when complete, so a
directory named ``step-N`` is either complete or damaged later (truncated, corrupted); a crash mid-write leaves
``.tmp``, which discovery ignores.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time

from launcher import backends
from launcher.errors import ConfigError

FORMAT = 1
MANIFEST = "manifest.json"
STATE = "trainer.pt"
_NAME = re.compile(r"^step-(\d{8,})(?:-mb(\d{6,}))?$")
POLICIES = ("error", "keep_global_batch", "keep_factor")


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

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._bytes += len(view)
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> "HashingFile":
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self.entry = {"bytes": self._bytes, "sha256": self._hash.hexdigest()}
        finally:
            self._file.close()


def commit(tmp: str, final: str, manifest: dict, hashed: dict | None = None) -> None:
    """Write ``tmp``'s manifest and rename it to ``final`` (atomic, never in place). ``hashed`` maps files of tmp
    (relative paths) to entries their writers made while writing (:class:`HashingFile`); every other file is read
    once to hash it (DeepSpeed's own)."""
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
    manifest = dict(manifest, files=files)
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
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
def verify(path: str) -> tuple[dict | None, str | None]:
    """``(manifest, None)`` if every file of checkpoint ``path`` is present with its recorded size and sha256,
    else ``(None, problem)``, the problem naming the file at fault."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, f"{mpath}: missing (an incomplete checkpoint)"
    except (OSError, ValueError) as exc:
        return None, f"{mpath}: unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        return None, f"{mpath}: not a format-{FORMAT} accum-sched manifest"
    for rel, meta in sorted(manifest["files"].items()):
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            return None, f"{fpath}: missing"
        size = os.path.getsize(fpath)
        if size != meta["bytes"]:
            return None, f"{fpath}: {size} bytes, the manifest says {meta['bytes']} (truncated or torn)"
        if file_digest(fpath) != meta["sha256"]:
            return None, f"{fpath}: sha256 differs from the manifest (corrupted)"
    return manifest, None


def find(root: str, resume: str, report=None) -> tuple[str, dict] | None:
    """The checkpoint to resume from: ``resume`` is ``"auto"`` (the newest valid one under ``root``, falling back
    past damaged ones, each reported by ``report(problem)``), a checkpoint directory, or a folder of them.

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
            manifest, problem = verify(path)
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
    """The config fields that change what is trained (not where outputs go, how it is logged or how many workers:
    the world size has its own policy, checkpoint.on_world_change). JSON-normalised."""
    d = cfg.to_dict()
    acc = {k: v for k, v in d["accumulation"].items() if k != "schedule"}
    raw = cfg.accumulation.schedule  # as written (with global_batch the factor depends on the world: not hashed)
    if raw is not None:
        from accum_sched.schedule import AccumulationSchedule

        raw = [list(m) for m in AccumulationSchedule(raw, cfg.accumulation.unit).milestones]
    acc["schedule"] = raw
    sub = {
        "run": {k: d["run"][k] for k in ("seed", "epochs", "precision")},
        "task": d["task"],
        "data": {k: d["data"][k] for k in ("micro_batch_size", "shuffle", "drop_last")},
        "accumulation": acc,
        "optimizer": d["optimizer"],
        "lr_scheduler": d["lr_scheduler"],
        "distributed": {k: d["distributed"][k] for k in ("backend", "deepspeed_config")},
    }
    sub["distributed"].update(backends.get(d["distributed"]["backend"]).training_fields(d["distributed"]))
    return json.loads(json.dumps(sub, sort_keys=True, default=str))


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(training_config(cfg), sort_keys=True).encode()).hexdigest()


def _flatten(d, prefix="") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v and prefix.count(".") < 1:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _schema_default(field: str):
    from launcher.config import REQUIRED, SCHEMA

    section, _, key = field.partition(".")
    default = SCHEMA.get(section, {}).get(key)
    return _MISSING if default is None or default.default is REQUIRED else default.default


_MISSING = object()


def config_differences(manifest: dict, cfg) -> list[tuple[str, object, object]]:
    """``[(field, value in the checkpoint, value now)]`` for training fields that differ; empty if none.

    A field the checkpoint does not know (added to the schema since) counts as equal while it has its default."""
    if manifest.get("config_hash") == config_hash(cfg):
        return []
    old, new = _flatten(manifest.get("config")), _flatten(training_config(cfg))
    diffs = []
    for k in sorted(set(old) | set(new)):
        if k not in old and new.get(k) == _schema_default(k):
            continue
        if old.get(k, _MISSING) != new.get(k, _MISSING):
            diffs.append((k, old.get(k), new.get(k)))
    return diffs


def check_config(path: str, manifest: dict, cfg) -> list[tuple[str, object, object]]:
    """Raise ConfigError naming the first differing field unless checkpoint.force_resume; returns the differences."""
    diffs = config_differences(manifest, cfg)
    if diffs and not cfg.checkpoint.force_resume:
        field, old, new = diffs[0]
        more = f" (and {len(diffs) - 1} more field(s))" if len(diffs) > 1 else ""
        raise ConfigError(field, f"is {new!r} but checkpoint {path} was made with {old!r}{more}",
                          "resume with the config the run was started with, or set checkpoint.force_resume: true "
                          "(--set checkpoint.force_resume=true) to load it anyway")
    return diffs


# -- world size -------------------------------------------------------------------------------------------------
def factor_scale(manifest: dict, cfg, world: int) -> tuple[int, int]:
    """``(num, den)``: the factors this run uses are the config's (``cfg.schedule_for(world)``) x num / den.

    A run starts at 1/1. On a resume with the world size of the checkpoint the run keeps the checkpoint's scale. On
    another world size checkpoint.on_world_change decides: ``error`` (default) refuses; ``keep_factor`` keeps the
    factors the checkpoint ran with (the global batch changes with the world); ``keep_global_batch`` keeps
    micro x factor x world, which needs every factor of the schedule to come out whole. (A config with
    accumulation.global_batch derives its factor from the world already; the scale only corrects for that.)
    """
    num, den = (int(x) for x in manifest.get("factor_scale", (1, 1)))
    old = int(manifest["world_size"])
    if world == old:
        return num, den
    policy = cfg.checkpoint.on_world_change
    what = f"checkpoint {manifest.get('name', '')} was made by {old} workers, this run has {world}".replace("  ", " ")
    if manifest.get("partial_window"):
        raise ConfigError("checkpoint.on_world_change", f"{what}, and it was taken inside an accumulation window "
                          f"(a preemption): its partial gradients are per worker",
                          f"resume it with {old} workers, or resume from the checkpoint before it")
    if policy == "error":
        raise ConfigError("checkpoint.on_world_change", f"is 'error' and {what}",
                          f"resume with {old} workers, or set checkpoint.on_world_change: keep_global_batch "
                          f"(the factor is rescaled so micro x factor x world stays) or keep_factor")
    backends.get(cfg.distributed.backend).check_world_change(what, old)  # DeepSpeed: per-rank shards, refused
    per_world = cfg.accumulation.global_batch is not None  # the config's factor already scales as 1 / world
    if policy == "keep_global_batch" and not per_world:
        num, den = num * old, den * world
    elif policy == "keep_factor" and per_world:
        num, den = num * world, den * old
    g = math.gcd(num, den)
    num, den = num // g, den // g
    for key, factor in cfg.schedule_for(world).milestones:
        if factor * num % den:
            raise ConfigError("checkpoint.on_world_change",
                              f"{policy} cannot keep its promise on {world} workers ({what}): schedule entry "
                              f"{key}: {factor} would need factor {factor * num / den:g}",
                              "resume on a world size whose factors come out whole, or choose the other policy")
    return num, den


def scaled_milestones(milestones, scale: tuple[int, int]) -> dict[int, int]:
    num, den = scale
    return {key: factor * num // den for key, factor in milestones}


# -- metrics ----------------------------------------------------------------------------------------------------
def truncate_metrics(run_dir: str, step: int) -> int:
    """Keep the metrics.jsonl lines of optimizer steps <= ``step`` (a resumed run rewrites the rest, so none is
    duplicated or lost; a torn last line goes too). Atomic. Returns the lines kept."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and int(record.get("step", 0)) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


# -- before launch ----------------------------------------------------------------------------------------------
def preflight(cfg, resume: str | None) -> None:
    """`accum-sched run --resume`: the checkpoint exists and is intact, was made under this config (or
    force_resume), and the world size is acceptable. ConfigError (exit 2) otherwise; no torch, no worker."""
    if not resume:
        return
    found = find(checkpoint_root(cfg), resume)
    if found is None:
        return
    path, manifest = found
    manifest = dict(manifest, name=path)
    check_config(path, manifest, cfg)
    factor_scale(manifest, cfg, cfg.world_size)
