"""Whether and how a run resumes: :func:`plan_resume`, the one implementation of the resume checks. Torch-free.

Two callers reach the same verdict through it: `accum-sched run` / `accum-sched slurm` before anything is launched
(``preflight``: a wrong config or world size is a one-line error with exit 2 on the login node), and the
workers' Checkpointer (rank 0 plans, every rank gets the plan or the same error), which must check again because a
restarted worker group or a requeued SLURM job picks its checkpoint by itself, after the launcher checked.

The checks, in order: which checkpoint (``store.find``: intact, newest valid for ``auto``), whether it was made
under this config (the config hash; checkpoint.force_resume loads it anyway and keeps the differences for warnings),
and whether this world size may resume it (checkpoint.on_world_change, which may rescale the schedule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from accum_sched.schedule import AccumulationSchedule
from launcher import backends
from launcher.checkpoint import store
from launcher.checkpoint.manifest import Manifest, as_manifest
from launcher.errors import ConfigError

POLICIES = ("error", "keep_global_batch", "keep_factor")
ELASTIC_ENV = "ACCUM_SCHED_ELASTIC"  # "1" in an elastic run's workers (set by launcher/launch/torchrun.py)


@dataclass(frozen=True)
class ResumePlan:
    """What a run starts from. ``path`` None: from scratch (``fresh``: nothing asked to resume, so an earlier run's
    checkpoints are moved aside; else ``--resume auto`` found none yet, or a restart found none to continue)."""

    path: str | None = None
    manifest: Manifest | None = None
    scale: tuple[int, int] = (1, 1)  # the factors are the config's x num / den (checkpoint.on_world_change)
    diffs: tuple = ()  # (field, value in the checkpoint, value now): training fields changed under force_resume
    fresh: bool = True
    notes: tuple[str, ...] = ()  # what a worker says on stdout about the choice (not said before launch)

    def schedule(self, config_schedule):
        """The schedule to train with: the config's, rescaled when a world-size change keeps the global batch."""
        if self.scale == (1, 1):
            return config_schedule
        return AccumulationSchedule(scaled_milestones(config_schedule.milestones, self.scale), config_schedule.unit)

    def warnings(self) -> list[str]:
        """One line for every difference together (a probe of `accum-sched cbs` changes several on purpose)."""
        if not self.diffs:
            return []
        line = "warning: checkpoint.force_resume: " + "; ".join(f"{field} was {old!r} in the checkpoint, now {new!r}"
                                                                for field, old, new in self.diffs)
        if any(field.startswith("lr_scheduler") for field, _, _ in self.diffs):  # the checkpointer's load rule
            line += " (the LR scheduler differs: it starts afresh at this step)"
        return [line]


def plan_resume(cfg, world: int, resume: str | None, *, restarts: int = 0, root: str | None = None,
                report=None, exclude: tuple[str, ...] = (), elastic: bool = False) -> ResumePlan:
    """Plan a run of ``world`` workers under ``cfg``. ``resume``: None (start afresh), ``"auto"`` or a path.
    ``restarts`` > 0 (a restarted worker group, a requeued job): continue from the newest valid checkpoint, falling
    back to ``resume`` when the failed attempt had not saved one yet. ``report(problem)`` hears of every damaged
    checkpoint skipped; ``exclude``: checkpoints ``auto`` passes over (they failed to load). ``elastic`` (a group
    of an elastic run, docs/elastic.md): every group continues like a restart, from the newest checkpoint it can
    use on its world size. Raises ConfigError (one line) when the run must not start."""
    restarts = max(restarts, 1) if elastic else restarts
    if resume is None and restarts == 0:
        return ResumePlan()
    root = root if root is not None else store.checkpoint_root(cfg)
    notes = ()
    found = None
    if restarts > 0:
        found = store.find(root, "auto", report, exclude)
    if found is None and not (restarts > 0 and resume in (None, "auto")):
        found = store.find(root, resume, report, exclude)
        if found is None:
            notes = (f"--resume auto: no checkpoint in {root} yet; starting afresh",)
    if found is None:
        return ResumePlan(fresh=False, notes=notes)
    path, manifest = found
    if elastic and not usable_on(manifest, world):  # the newest checkpoint this world can continue from
        found, notes = _newest_usable(root, world, report, (*exclude, path))
        notes = (f"elastic: passing over checkpoint {path}: taken inside an accumulation window (or a stream's "
                 f"epoch) by {manifest.world_size} workers, this group has {world}", *notes)
        if found is None:  # nothing before it: start afresh (the run had not completed a window)
            return ResumePlan(fresh=False, notes=notes)
        path, manifest = found
    diffs = check_config(path, manifest, cfg)
    scale = factor_scale(manifest, cfg, world, path)
    return ResumePlan(path=path, manifest=manifest, scale=scale, diffs=tuple(diffs), fresh=False, notes=notes)


def usable_on(manifest: Manifest, world: int) -> bool:
    """Whether ``world`` workers can continue from a checkpoint at all: one taken inside an accumulation window
    (its partial gradients are per worker) or inside a stream's epoch (positions per worker) only on its own world
    size. An elastic group re-forms after its workers were stopped with SIGTERM, which commits the open window: on
    another world size it continues from the checkpoint before, at a window boundary. (The config and the
    on_world_change policy are checked after, on the checkpoint chosen, and may still refuse.)"""
    manifest = as_manifest(manifest)
    return manifest.world_size == world or not (manifest.partial_window or manifest.stream)


def _newest_usable(root: str, world: int, report, exclude: tuple[str, ...]):
    """``((path, manifest) or None, notes)``: the newest intact checkpoint under ``root`` that ``world`` workers can
    continue from, passing over damaged ones (``report``) and unusable ones (a note each)."""
    notes = []
    for _, path in reversed(store.list_checkpoints(root)):
        if path in exclude:
            continue
        manifest, problem = store.verify(path)
        if manifest is None:
            if report is not None:
                report(f"skipping damaged checkpoint: {problem}")
        elif usable_on(manifest, world):
            return (path, manifest), tuple(notes)
        else:
            notes.append(f"elastic: passing over checkpoint {path}: taken inside an accumulation window by "
                         f"{manifest.world_size} workers")
    return None, tuple(notes)


# -- config identity --------------------------------------------------------------------------------------------
def config_differences(manifest: Manifest, cfg) -> list[tuple[str, object, object]]:
    """``[(field, value in the checkpoint, value now)]`` for training fields that differ (store.config_differences:
    a key the checkpoint does not record counts as its default)."""
    return store.config_differences(manifest, cfg)


def check_config(path: str, manifest: Manifest, cfg) -> list[tuple[str, object, object]]:
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
def factor_scale(manifest: Manifest, cfg, world: int, path: str = "") -> tuple[int, int]:
    """``(num, den)``: the factors this run uses are the config's (``cfg.schedule_for(world)``) x num / den.

    A run starts at 1/1. On a resume with the world size of the checkpoint (at ``path``) the run keeps the
    checkpoint's scale. On another world size checkpoint.on_world_change decides: ``error`` (default) refuses;
    ``keep_factor`` keeps the factors the checkpoint ran with (the global batch changes with the world);
    ``keep_global_batch`` keeps micro x factor x world, which needs every factor of the schedule to come out whole.
    (A config with accumulation.global_batch derives its factor from the world already; the scale only corrects for
    that.)
    """
    manifest = as_manifest(manifest)  # or a mapping of its fields (tests)
    num, den = manifest.factor_scale
    old = manifest.world_size
    if world == old:
        return num, den
    policy = cfg.checkpoint.on_world_change
    what = f"checkpoint {path} was made by {old} workers, this run has {world}".replace("  ", " ")
    if manifest.partial_window:
        raise ConfigError("checkpoint.on_world_change", f"{what}, and it was taken inside an accumulation window "
                          f"(a preemption): its partial gradients are per worker",
                          f"resume it with {old} workers, or resume from the checkpoint before it")
    if manifest.stream:
        raise ConfigError("checkpoint.on_world_change", f"{what}, and it was taken inside an epoch of a stream: "
                          f"each worker's position in its shard of the stream is its own",
                          f"resume it with {old} workers, or from a checkpoint taken at an epoch's end")
    if policy == "error":
        raise ConfigError("checkpoint.on_world_change", f"is 'error' and {what}",
                          f"resume with {old} workers, or set checkpoint.on_world_change: keep_global_batch "
                          f"(the factor is rescaled so micro x factor x world stays) or keep_factor")
    # the back end that wrote the checkpoint's files decides (DeepSpeed: per-rank shards, refused); a hand-made
    # manifest names none
    writer = manifest.backend if manifest.backend in backends.names() else cfg.distributed.backend
    backends.get(writer).check_world_change(what, old)
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


# -- before launch ----------------------------------------------------------------------------------------------
def preflight(cfg, resume: str | None) -> None:
    """`accum-sched run --resume`: the checkpoint exists and is intact, was made under this config (or
    force_resume), and the world size is acceptable. ConfigError (exit 2) otherwise; no torch, no worker. The
    checks are the workers' own (plan_resume)."""
    if resume:
        plan_resume(cfg, cfg.world_size, resume)
