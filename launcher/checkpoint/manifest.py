"""A checkpoint's ``manifest.json`` as a typed value: what the checkpoint is (position, world, config identity, the
back end that wrote it) and the size and sha256 of every file in it. Torch-free (read before launch).

On disk the JSON keys are the field names below. A manifest of another ``version`` is not read: one without the
current version was written by an earlier development version of accum-sched (0.1.0 was never released, so there
is nothing to migrate), one with a higher version by a newer release. Either is a one-line refusal naming the file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FORMAT = 1  # the on-disk layout (step-N directories, trainer.pt, this manifest); a new one is not readable by old code
VERSION = 5  # the manifest's fields: backend and sharded (5), stream (4), version (3), partial_window (2)
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A manifest this code cannot read (another version, or a field of the wrong kind)."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says. ``files`` maps paths relative to the checkpoint to ``{"bytes", "sha256"}``."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the engine's epoch and micro-batch within it at the save
    micro_batch: int = 0
    batches_per_epoch: int = 0  # micro-batches per rank in that epoch
    world_size: int = 1
    factor_scale: tuple[int, int] = (1, 1)  # (num, den): the run's factors are the config's x num / den
    micro_batch_size: int = 0
    config_hash: str = ""
    config: dict = field(default_factory=dict)  # store.training_config() of the run that saved it
    reason: str = ""  # epoch | step | stop | preempt | request
    backend: str = ""  # the launcher back end that wrote it (distributed.backend; "" in hand-made ones)
    sharded: bool = False  # the back end wrote model and optimizer as per-rank files of its own, not in trainer.pt
    skipped_steps: int = 0
    created: float = 0.0  # time.time() at the save
    partial_window: bool = False  # taken inside a window: window-rank<R>.pt hold each rank's open window
    stream: bool = False  # taken inside an epoch of a stream: stream-rank<R>.pt hold each rank's loader position
    files: dict = field(default_factory=dict)
    format: int = FORMAT
    version: int = VERSION

    def to_dict(self) -> dict:
        """The JSON object written to ``manifest.json`` (plain lists and numbers)."""
        out = dataclasses.asdict(self)
        out["factor_scale"] = list(self.factor_scale)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> Manifest:
        """The inverse of :meth:`to_dict`: a current-version manifest with every field (else ManifestError)."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(raw))
        if missing:
            raise ManifestError(f"a version-{VERSION} manifest lacks {', '.join(missing)}")
        return _typed(cls(**{k: raw[k] for k in names}))

    def with_files(self, files: dict) -> Manifest:
        return dataclasses.replace(self, files=files)


def _typed(m: Manifest) -> Manifest:
    """Fields in their declared kinds (JSON gives a list for the tuple); ManifestError for a value of another kind."""
    try:
        num, den = (int(x) for x in m.factor_scale)
        return dataclasses.replace(
            m, step=int(m.step), epoch=int(m.epoch), micro_batch=int(m.micro_batch),
            batches_per_epoch=int(m.batches_per_epoch), world_size=int(m.world_size), factor_scale=(num, den),
            micro_batch_size=int(m.micro_batch_size), config_hash=str(m.config_hash), config=dict(m.config or {}),
            reason=str(m.reason), backend=str(m.backend), sharded=bool(m.sharded), skipped_steps=int(m.skipped_steps),
            created=float(m.created), partial_window=bool(m.partial_window), stream=bool(m.stream),
            files=dict(m.files or {}), format=int(m.format), version=int(m.version))
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"a field has a value of the wrong kind ({exc})") from exc


def read(raw) -> Manifest:
    """``manifest.json``'s JSON object as a Manifest: the current version only (see the module's docstring); a field it
    lacks (a hand-made one) gets the default above, a key it does not know is dropped. ManifestError otherwise."""
    if not isinstance(raw, dict):
        raise ManifestError(f"not a JSON object but {type(raw).__name__}")
    version = raw.get("version")
    if version != VERSION:
        if isinstance(version, int) and version > VERSION:
            raise ManifestError(f"manifest version {version} is newer than this accum-sched reads ({VERSION}); "
                                f"resume it with the release that wrote it")
        raise ManifestError(f"written by an earlier development version of accum-sched (manifest version "
                            f"{version if version is not None else '1 or 2'}, this one reads {VERSION}); start "
                            f"afresh without --resume, or resume it with the version that wrote it")
    return as_manifest(raw)


def as_manifest(value) -> Manifest:
    """``value`` if it is a Manifest, else a mapping of current-version fields as one (absent fields at their
    defaults): what tests and :func:`read` hand in."""
    if isinstance(value, Manifest):
        return value
    known = {f.name for f in dataclasses.fields(Manifest)}
    return _typed(Manifest(**{k: v for k, v in value.items() if k in known}))
