"""A checkpoint's ``manifest.json`` as a typed value: what the checkpoint is (position, world, config identity) and
the size and sha256 of every file in it. Torch-free (read before launch).

On disk the JSON keys are the field names below, exactly as releases before this module wrote them, plus
``version`` (added with it). :func:`migrate` reads every manifest this project has written:

- version 1 (the first checkpoints): no ``partial_window``, no ``version``;
- version 2 (stops inside an accumulation window): ``partial_window`` added, still no ``version``;
- version 3: ``version`` written;
- version 4 (streams): ``stream`` added (False before).

A field a manifest lacks (an older one, or one written by hand in a test) gets the default below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FORMAT = 1  # the on-disk layout (step-N directories, trainer.pt, this manifest); a new one is not readable by old code
VERSION = 4  # the manifest's fields; older versions are read through migrate()
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A manifest this code cannot read (written by a newer release, or a field of the wrong kind)."""


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
    deepspeed: bool = False  # DeepSpeed's own files are in deepspeed/
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
        """The inverse of :meth:`to_dict`: a current-version manifest with every field (else ManifestError; older
        or partial ones go through :func:`migrate`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(raw))
        if missing:
            raise ManifestError(f"a version-{VERSION} manifest lacks {', '.join(missing)}")
        return _typed(cls(**{k: raw[k] for k in names}))

    def with_files(self, files: dict) -> Manifest:
        return dataclasses.replace(self, files=files)

    # The manifest was a dict before; a caller outside the launcher that indexed it by key still can.
    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def get(self, key: str, default=None):
        return self.to_dict().get(key, default)


def _typed(m: Manifest) -> Manifest:
    """Fields in their declared kinds (JSON gives a list for the tuple); ManifestError for a value of another kind."""
    try:
        num, den = (int(x) for x in m.factor_scale)
        return dataclasses.replace(
            m, step=int(m.step), epoch=int(m.epoch), micro_batch=int(m.micro_batch),
            batches_per_epoch=int(m.batches_per_epoch), world_size=int(m.world_size), factor_scale=(num, den),
            micro_batch_size=int(m.micro_batch_size), config_hash=str(m.config_hash), config=dict(m.config or {}),
            reason=str(m.reason), deepspeed=bool(m.deepspeed), skipped_steps=int(m.skipped_steps),
            created=float(m.created), partial_window=bool(m.partial_window), stream=bool(m.stream),
            files=dict(m.files or {}), format=int(m.format), version=int(m.version))
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"a field has a value of the wrong kind ({exc})") from exc


def raw_version(raw: dict) -> int:
    """The version a manifest was written as: its ``version`` key, else told by the fields it has."""
    if "version" in raw:
        return int(raw["version"])
    return 2 if "partial_window" in raw else 1


def migrate(raw: dict) -> Manifest:
    """A manifest of any version this project wrote, as the current one. Keys it does not know are dropped."""
    if not isinstance(raw, dict):
        raise ManifestError(f"not a JSON object but {type(raw).__name__}")
    version = raw_version(raw)
    if version > VERSION:
        raise ManifestError(f"manifest version {version} is newer than this accum-sched reads ({VERSION}); "
                            f"resume it with the release that wrote it")
    known = {f.name for f in dataclasses.fields(Manifest)}
    values = {k: v for k, v in raw.items() if k in known}
    if version < 2:
        # stops inside a window came with version 2: every earlier one is at a boundary
        values["partial_window"] = False
    values["version"] = VERSION
    return _typed(Manifest(**values))


def as_manifest(value) -> Manifest:
    """``value`` if it is a Manifest, else the dict migrated (callers that still hand in the JSON object)."""
    return value if isinstance(value, Manifest) else migrate(value)
