"""The workers' Checkpointer: save at optimizer-step boundaries, resume at the exact micro-batch.

What a checkpoint holds (``trainer.pt``, written by rank 0, loadable with ``torch.load(weights_only=True)``: only
tensors and plain Python values): the trainer's stateful parts (launcher/checkpoint/parts.py: model, optimizer,
LR scheduler, GradScaler, ``engine.state_dict()`` (epoch, micro-batch within it, counters), the sampler epoch,
validation), the last StepInfo, and every rank's RNG states (torch, numpy, python, CUDA), gathered to rank 0 so
one file holds them all. A DeepSpeed engine writes its own per-rank files into the same directory
(``ds_engine.save_checkpoint``), and an FSDP2 run its DCP shards under ``fsdp/`` (launcher/backends/fsdp.py);
``trainer.pt`` then holds no model or optimizer. ``manifest.json`` is launcher/checkpoint/manifest.py.

When: at every epoch end, every ``checkpoint.every_n_steps`` optimizer steps (from the engine's on_step
callback), and where ``engine.should_stop`` turns True (preemption). The last may be inside a window (the engine's
stop_at="micro_batch"): then every rank also writes ``window-rank<R>.pt``, its accumulated local gradient and its
share of the window's counts, and the resume continues that window.

A stream (a task's IterableDataset, launcher/train/streams.py) has no sampler to position: a save inside one of its
epochs has every rank write ``stream-rank<R>.pt``, its loader's state after the micro-batches trained, and a resume
loads it back into the same rank's loader (so only on the same world size).

Which checkpoint, and whether it may be resumed, is launcher/checkpoint/resume.py's plan_resume (the same checks
`accum-sched run` made before launch). Where in the data the run continues is data_position.py; the RNG, rng.py.

Collective: every method that saves or restores must be called on every rank at the same point.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time

import torch

from accum_sched import engine_state as engine_format
from accum_sched.step_info import StepInfo
from launcher.checkpoint import coordination, store
from launcher.checkpoint.background import InFlight, host_copy
from launcher.checkpoint.collective import CheckpointError, Ranks, must_see
from launcher.checkpoint.data_position import (
    EpochLoader,
    deal,
    global_order,
    invariant_position,
    invariant_resume,
    invariant_sampler,
    redealt_loader,
    resume_position,
)
from launcher.checkpoint.manifest import Manifest
from launcher.checkpoint.parts import (
    check_parts,
    load_data_parts,
    load_model_parts,
    load_shards,
    own_optimizer_state,
    save_parts,
    save_shards,
    stage_shards,
)
from launcher.checkpoint.pickle_scan import UnsafePickle, check_state_file, refusal
from launcher.checkpoint.resume import ELASTIC_ENV, ResumePlan, plan_resume
from launcher.checkpoint.rng import RankRng, rng_state, seed_rank, set_rng_state
from launcher.errors import ConfigError

# names tests and benchmarks import from here
__all__ = ["CheckpointError", "Checkpointer", "deal", "global_order", "own_optimizer_state", "rng_state",
           "seed_rank", "set_rng_state"]


class Checkpointer:
    """Saves and restores one rank's training state. Built by the Trainer before its schedule (the resume point
    decides a rescaled schedule on a world-size change); ``restore(parts, loader)`` before training.

    ``resume`` is None (start afresh: checkpoints of an earlier run in the folder are moved aside), ``"auto"`` or a
    path. A restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) or a requeued SLURM job (SLURM_RESTART_COUNT
    > 0) resumes from the newest valid checkpoint by itself, falling back to ``resume`` when the failed attempt
    had not saved one yet.
    """

    def __init__(self, cfg, rank: int, world: int, resume: str | None = None, device=None, group=None):
        self.cfg, self.rank, self.world = cfg, rank, world
        # every collective runs on the gloo coordination group (checkpoint/coordination.py), not the default one
        self.group = group if group is not None else coordination.group()
        self.ranks = Ranks(rank, world, self.group)
        # the collectives under their old names (tests/accum_sched/test_gpu_readiness.py drives them on a real group)
        self._on_rank0, self._together, self._must_see = self.ranks.on_rank0, self.ranks.together, must_see
        self.device = device or torch.device("cpu")
        self.root = os.path.abspath(store.checkpoint_root(cfg))
        self.hash = store.config_hash(cfg)
        # a restart of torchrun's worker group, or of a requeued SLURM job: both continue from the newest checkpoint
        restarts = sum(int(os.environ.get(name, "0") or 0)
                       for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        # an elastic run's group (launcher/launch/torchrun.py: elastic_env) continues from the newest usable
        # checkpoint every time: a group re-formed for a node that joined restarts no counter
        elastic = os.environ.get(ELASTIC_ENV) == "1"
        restarts += elastic
        report = lambda problem: self.ranks.say(problem, sys.stderr)
        self._replan = lambda exclude=(): plan_resume(cfg, world, resume, restarts=restarts, root=self.root,
                                                      report=report, exclude=exclude, elastic=elastic)
        self._auto = resume == "auto" or restarts > 0  # may fall back past a checkpoint that fails to load
        # a fresh start reads no disk: every rank plans it alone, without a collective
        self.plan: ResumePlan = self._replan() if resume is None and restarts == 0 else self._on_rank0(self._replan)
        for note in self.plan.notes:
            self.ranks.say(note)
        if self.plan.path is not None:
            self._together(f"resuming from {self.plan.path}", lambda: must_see(self.plan.path, store.MANIFEST))
        self.parts: dict | None = None
        self.rng = RankRng(self.device, cfg.run.seed, rank)
        self._loader = None  # the trainer's loader (its length is the manifest's fallback for batches_per_epoch)
        self._last_saved: str | None = None  # path of the newest checkpoint of this position
        self._epoch_batches: int | None = None
        self._order: tuple[int, list[int]] | None = None  # (epoch, global sample order) re-dealt after a world change
        self._order_loader = None
        self._invariant_start: tuple[int, int] | None = None  # (epoch, sample position): data.sampler invariant
        self.in_flight = InFlight(self.ranks.say)  # checkpoint.async: the save being written beside training

    @property
    def engine(self):
        return self.parts["engine"]

    # -- resume -------------------------------------------------------------------------------------------------
    def restore(self, parts: dict, loader) -> int:
        """Take the trainer's stateful ``parts`` (launcher/checkpoint/parts.py) and its epoch ``loader``, and load
        the checkpoint planned at construction into them, if any. Returns its step (0 if none). Only once every
        rank has loaded it does rank 0 cut metrics.jsonl back to that step and set newer checkpoints aside: a
        checkpoint that fails to load on any rank leaves the run directory as it was. ``--resume auto`` (and a
        restart) then falls back to the newest checkpoint that loads, saying which one it skipped."""
        self.parts, self._loader = check_parts(parts), loader
        run_dir = self.cfg.run.output_dir
        if self.plan.path is None:
            self._start_afresh(run_dir)
            return 0
        for warning in self.plan.warnings():
            self.ranks.say(warning, sys.stderr)
        failed: list[str] = []
        while True:
            step, error = self._load_on_every_rank(self.plan.path, self.plan.manifest)
            if error is None:
                break
            if not self._auto or isinstance(error, ConfigError):
                raise error
            failed.append(self.plan.path)
            self.ranks.say(f"--resume auto: skipping checkpoint {self.plan.path}: it failed to load ({error}); "
                           "trying the newest one before it", sys.stderr)
            try:
                plan = self._on_rank0(lambda: self._replan(tuple(failed)))
            except CheckpointError:  # no other checkpoint: the load's own error says more
                raise error from None
            if plan.path is None or plan.scale != self.plan.scale:
                raise error
            self.plan = plan
            self._together(f"resuming from {plan.path}", lambda: must_see(plan.path, store.MANIFEST))
        path, manifest = self.plan.path, self.plan.manifest
        if self.rank == 0:
            self._tidy_after_resume(run_dir, path, step)
            self.ranks.say(f"resumed from {path} (step {step}, {self._where(manifest)}; saved by "
                           f"{manifest.world_size} workers)")
        self.ranks.barrier()
        return step

    def _load_on_every_rank(self, path: str, manifest: Manifest) -> tuple[int | None, Exception | None]:
        """Load checkpoint ``path`` on this rank and agree on the outcome: ``(step, None)`` where every rank loaded
        it, else ``(None, error)``: this rank's own error, or the first failing rank's (a planted pickle read by
        that rank only stays the one-line UnsafePickle on every rank)."""
        try:
            step, mine = self._load_from(path, manifest), None
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it before anyone moves a file
            step, mine = None, exc
        line = None if mine is None else (f"rank {self.rank}: {type(mine).__name__}: "
                                          f"{(str(mine).splitlines() or [''])[0]}", type(mine).__name__, str(mine))
        outcomes = self.ranks.gather(line, "loading the checkpoint")
        errors = [o for o in outcomes if o is not None]
        if not errors:
            return step, None
        if mine is not None:
            return None, mine
        text, kind, message = errors[0]
        if kind == "UnsafePickle":
            return None, UnsafePickle(message)
        return None, CheckpointError(text)

    def _load_from(self, path: str, manifest: Manifest) -> int:
        """This rank's part of the resume from ``path``: every state file into its part. Returns the step."""
        state = self._load(os.path.join(path, store.STATE))
        self._load_model(state, path)
        try:  # a trainer.pt of an earlier development version: one line, before anything is loaded into the run
            engine_format.check_format(state["engine"])
        except ValueError as exc:
            raise CheckpointError(f"{os.path.join(path, store.STATE)}: {exc}") from None
        engine_state = self._resume_position(dict(state["engine"]), state, manifest)
        if manifest.partial_window:
            engine_state["window"] = self._load(os.path.join(path, f"window-rank{self.rank}.pt"))["window"]
        self._load_engine(state, engine_state)
        if manifest.stream:  # this rank's loader position inside the epoch
            stream = self._load(os.path.join(path, f"stream-rank{self.rank}.pt"))["stream"]
            self.parts["stream"].load_state_dict(stream, int(engine_state["micro_in_epoch"]))
        step = int(engine_state["optimizer_steps"])
        self.rng.plan(state["rng"], self._mid_epoch(engine_state, manifest), int(engine_state["epoch_index"]), step)
        self._last_saved = store.step_dir(self.root, step, engine_state["micro_in_epoch"]
                                          if manifest.partial_window else None)
        return step

    def _start_afresh(self, run_dir: str) -> None:
        """No checkpoint to resume: rank 0 moves an earlier run's checkpoints aside and empties metrics.jsonl."""
        if self.rank != 0:
            return
        moved = store.supersede(self.root) if self.plan.fresh else None
        if moved is not None:
            aside, old = moved
            self.ranks.say(f"starting afresh: moved {len(old)} checkpoint(s) of an earlier run to {aside} "
                           f"(run with --resume to continue a run; delete that folder when not needed)", sys.stderr)
        rewind = store.rewind_metrics(run_dir, 0)  # an earlier run's lines: kept aside, not deleted
        if rewind.aside:
            self.ranks.say(f"starting afresh: moved the {rewind.aside} line(s) of metrics.jsonl to "
                           f"{os.path.join(run_dir, store.REWOUND)}", sys.stderr)

    def _resume_position(self, engine_state: dict, state: dict, manifest: Manifest) -> dict:
        """The engine position to continue from (data_position.resume_position; sets the re-dealt self._order), or
        under data.sampler invariant the sample position its windows continue from (data_position.invariant_resume)."""
        invariant = invariant_sampler(self.parts["sampler"]) is not None
        if invariant or state.get("invariant_position") is not None:
            engine_state, self._invariant_start = invariant_resume(engine_state, state.get("invariant_position"),
                                                                   invariant)
            if invariant:
                return engine_state
        order = state.get("epoch_order")
        old_world = manifest.world_size
        full_order = lambda epoch: global_order(self._loader.dataset, epoch, old_world,
                                                self.cfg.data.shuffle, self.cfg.run.seed)
        engine_state, self._order = resume_position(engine_state, order, old_world, self.world,
                                                    manifest.batches_per_epoch, self.cfg.data.micro_batch_size,
                                                    full_order)
        return engine_state

    def _mid_epoch(self, engine_state: dict, manifest: Manifest) -> bool:
        """Saved inside an epoch on this world size: the RNG replays that epoch's loader start (rng.RankRng)."""
        micro = int(engine_state["micro_in_epoch"])
        within = manifest.stream or micro < manifest.batches_per_epoch  # a stream's epoch has no known length
        return manifest.world_size == self.world and 0 < micro and within

    def _load_engine(self, state: dict, engine_state: dict) -> None:
        self.engine.load_state_dict(engine_state)
        if state.get("last_step"):
            self.engine.last_step = StepInfo.from_dict(state["last_step"])  # flat metrics line -> StepInfo
        load_data_parts(self.parts, state)

    def _tidy_after_resume(self, run_dir: str, path: str, step: int) -> None:
        """Rank 0: checkpoints after the one resumed are a future that did not happen (damaged, or the user resumed
        an older one): set them aside; metrics.jsonl is cut back to ``step``."""
        mine = store.checkpoint_key(path)
        for _, p in store.list_checkpoints(self.root):
            if store.checkpoint_key(p) > mine:
                self.ranks.say(f"set aside {p} -> {store.set_aside(p)}", sys.stderr)
        for note in store.rewind_metrics(run_dir, step).notes(run_dir, step):  # nothing of it silently missing
            self.ranks.say(note, sys.stderr)

    def _where(self, manifest: Manifest) -> str:
        engine = self.engine
        if self._invariant_start is not None and not engine.window_open:
            return f"epoch {self._invariant_start[0]}, sample {self._invariant_start[1]} of its order"
        if self._order is not None and manifest.world_size != self.world:
            return f"epoch {self._order[0]}: the {len(self._order[1])} samples not trained yet, re-dealt"
        where = f"epoch {engine.epoch_index}, micro-batch {engine.micro_in_epoch}"
        return where + (" inside a window" if engine.window_open else "")

    def _load(self, path: str) -> dict:
        # Only what we wrote ourselves is loaded here, with weights_only (tensors and plain values); DeepSpeed's
        # own shards are loaded by DeepSpeed's load_checkpoint (parts.load_shards), without weights_only: their
        # pickles are checked against an allow-list first (launcher/checkpoint/pickle_scan.py).
        check_state_file(path)  # a planted, legacy-format or raw pickle: the one line of every load path
        try:
            # mmap: tensors stay file-backed pages (shared through the page cache by the ranks of a node) until
            # load_state_dict copies them into place, instead of one private copy of the whole file per rank
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # checksums passed, so this is a format problem: name the file
            # weights_only's refusal runs to a page of advice (to load without it, the one thing not to do here)
            imported = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = (f"it would import {imported.group(1)}, refused by weights_only" if imported else
                    f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
            if imported:  # UnsafePickle: one line from the worker
                raise refusal(path, what) from exc
            raise CheckpointError(f"{path}: cannot be loaded ({what}); nothing of it was run: resume from an earlier "
                                  "checkpoint (--resume PATH), or start afresh without --resume") from exc

    def _load_model(self, state: dict, path: str) -> None:
        optimizer = self._optimizer_changed()
        if optimizer is not None and not self.parts["backend"].sharded_checkpoint:
            # another optimizer's state (adamw's moments for sgd) fails inside its first step (KeyError: 'momentum')
            self.ranks.say(f"warning: checkpoint.force_resume: the optimizer was {optimizer[0]!r} in the checkpoint, "
                           f"now {optimizer[1]!r}: its state is dropped, {optimizer[1]!r} starts afresh at this step "
                           f"(learning rate from the config)", sys.stderr)
            state = {key: value for key, value in state.items() if key != "optimizer"}
        elif optimizer is not None:
            err = ConfigError("optimizer.name", f"is {optimizer[1]!r} but checkpoint {path} holds the state of "
                              f"{optimizer[0]!r} in the {self.cfg.distributed.backend} back end's own shards, which "
                              "cannot be loaded without it", f"resume with optimizer.name: {optimizer[0]}")
            err.every_rank = True  # launcher/worker.py: rank 0 says it for all
            raise err
        load_shards(self.parts, path)
        # force_resume under another LR scheduler (accum-sched cbs holds the LR): the saved state is another
        # scheduler's, so the configured one starts afresh from the optimizer's learning rate (said in the plan's
        # one warning line)
        changed = any(field.startswith("lr_scheduler") for field, _, _ in self.plan.diffs)
        load_model_parts(self.parts, state, lr_scheduler=not changed)

    def _optimizer_changed(self) -> tuple[str, str] | None:
        """(the checkpoint's optimizer, the config's) where force_resume loads a checkpoint of another optimizer."""
        for field, old, new in self.plan.diffs:
            if field == "optimizer.name":
                return str(old), str(new)
        return None

    def loader(self, epoch: int, loader):
        """What the engine should iterate in ``epoch`` (with skip=False): ``loader`` positioned at the resume point
        and wrapped to track the RNG, or the re-dealt rest of an epoch interrupted on another world size."""
        if self._order is not None and self._order[0] == epoch:
            if self._order_loader is None:
                self._order_loader = redealt_loader(loader, deal(self._order[1], self.world, self.rank))
            loader = self._order_loader
        if self._invariant_start is not None and self._invariant_start[0] == epoch:
            invariant_sampler(self.parts["sampler"]).start_at_sample(self._invariant_start[1])
        start = self.engine.resume_offset(epoch)
        if self.parts["stream"] is not None:  # positioned by its loaded state, if any
            return self.parts["stream"].epoch(start, self.rng, self.rng.replay(epoch))
        return EpochLoader(loader, self.rng, start, self.rng.replay(epoch), on_iter=self._note_epoch_batches)

    def _note_epoch_batches(self, batches: int) -> None:
        self._epoch_batches = batches

    # -- save ---------------------------------------------------------------------------------------------------
    def on_step(self, info) -> None:
        """engine.on_step callback: every ``every_n_steps`` steps, and when the ranks agreed to stop."""
        every = self.cfg.checkpoint.every_n_steps
        if (every and info.step % every == 0) or self.engine.should_stop:
            self.save("stop" if self.engine.should_stop else "step")

    def epoch_end(self) -> None:
        self.save("epoch")

    def save(self, reason: str) -> str:
        """Save where the engine stands (a step boundary, or inside a window at a stop) and return the checkpoint's
        path; ``reason`` is the manifest's (epoch, step, stop, preempt, request). Collective. If this position is
        saved already (on_step saves at the stop step by itself) it only returns that checkpoint's path, once it is
        committed. Under checkpoint.async the step and epoch checkpoints are written in the background
        (:meth:`_save_in_background`); a stop's is written here, after the one in flight."""
        engine = self.engine
        step = engine.optimizer_steps
        final = store.step_dir(self.root, step, engine.micro_in_epoch if engine.window_open else None)
        if final == self._last_saved:
            self.wait()
            return final
        self.in_flight.wait(next_save=True)  # at most one in flight
        tmp = final + ".tmp"
        # Three phases, each closed by a gather of every rank's error (if any): a rank that fails to write makes
        # all of them raise at once instead of leaving the others waiting in a barrier until the timeout.
        self._together(f"preparing {tmp}", lambda: self._make_tmp(tmp) if self.rank == 0 else None)
        # every rank sees what rank 0 made (else DeepSpeed shards land on a node's own disk), checked before any rank
        # enters DeepSpeed's collective save, which a rank that stopped alone would leave hanging
        self._together(f"preparing {tmp}", lambda: must_see(tmp))
        if self.cfg.checkpoint.async_ and reason in ("step", "epoch"):
            self._save_in_background(tmp, final, step, reason)
            self._last_saved = final
            return final
        rngs = self.ranks.gather(self.rng.snapshot(), f"gathering RNG states for {tmp}")
        engine_state = engine.state_dict()
        window = engine_state.pop("window", None)  # this rank's open window (a stop inside it): per rank
        stream = None if self.parts["stream"] is None else self.parts["stream"].state_at(engine.micro_in_epoch)

        def write():
            save_shards(self.parts, tmp)
            hashed = self._write_own_files(tmp, window, stream)  # hashed while written: no second read at commit
            if self.rank == 0:
                hashed[store.STATE] = self._write_state(os.path.join(tmp, store.STATE), self._state(engine_state),
                                                        rngs)
            return hashed

        hashed = {}
        for entries in self._failing_save(tmp, lambda: self._together(f"writing {tmp}", write)):
            hashed.update(entries or {})

        def commit():
            if self.rank == 0:
                manifest = self._manifest(step, engine_state, reason, window is not None, stream is not None)
                store.commit(tmp, final, manifest, hashed)
                store.rotate(self.root, self.cfg.checkpoint.keep_last)

        self._failing_save(tmp, lambda: self._together(f"committing {final}", commit))
        self._last_saved = final
        return final

    def _save_in_background(self, tmp: str, final: str, step: int, reason: str) -> None:
        """checkpoint.async: copy the state to host memory here (FSDP2: DCP's async_save stages its shards), then
        write, agree and commit in the background thread, on its own gloo group (launcher/checkpoint/background.py),
        in the same phases as :meth:`save`: every rank writes its files, then rank 0 writes trainer.pt (with every
        rank's RNG state, gathered in the first phase) and commits, the manifest last."""
        engine = self.engine
        engine_state = host_copy(engine.state_dict())  # no window: a stop inside one is saved synchronously
        rng = host_copy(self.rng.snapshot())
        stream = None if self.parts["stream"] is None else host_copy(self.parts["stream"].state_at(
            engine.micro_in_epoch))
        state = manifest = None
        if self.rank == 0:
            state = host_copy(self._state(engine_state))
            manifest = self._manifest(step, engine_state, reason, False, stream is not None)
        shards = stage_shards(self.parts, tmp, coordination.background_group())  # staged now, written by DCP
        ranks = Ranks(self.rank, self.world, coordination.background_group())

        def write():
            if shards is not None:
                shards()
            return self._write_own_files(tmp, None, stream), rng

        def job():
            written = self._failing_save(tmp, lambda: ranks.together(f"writing {tmp}", write))
            hashed = {rel: entry for entries, _ in written for rel, entry in entries.items()}

            def commit():
                if self.rank == 0:
                    hashed[store.STATE] = self._write_state(os.path.join(tmp, store.STATE), state,
                                                            [r for _, r in written])
                    store.commit(tmp, final, manifest, hashed)
                    store.rotate(self.root, self.cfg.checkpoint.keep_last)

            self._failing_save(tmp, lambda: ranks.together(f"committing {final}", commit))

        self.in_flight.submit(final, job)

    def wait(self, failing: bool = False) -> None:
        """Wait for the checkpoint in flight (checkpoint.async): the end of the run and a stop call this before
        they go on. ``failing``: the run is failing already; the save's own error is said, not raised."""
        try:
            self.in_flight.wait()
        except Exception as exc:  # noqa: BLE001 -- the run's own failure is the one to raise
            if not failing:
                raise
            print(f"accum-sched: rank {self.rank}: the checkpoint in flight failed too: {exc}", file=sys.stderr,
                  flush=True)
        finally:
            if failing:
                self.in_flight.close()

    def _write_own_files(self, tmp: str, window, stream) -> dict:
        """This rank's window-rank<R>.pt and stream-rank<R>.pt (where it has them); their manifest entries."""
        hashed = {}
        if window is not None:
            rel = f"window-rank{self.rank}.pt"
            hashed[rel] = self._write_file(os.path.join(tmp, rel), {"format": store.FORMAT, "rank": self.rank,
                                                                     "window": window})
        if stream is not None:
            rel = f"stream-rank{self.rank}.pt"
            hashed[rel] = self._write_file(os.path.join(tmp, rel), {"format": store.FORMAT, "rank": self.rank,
                                                                     "stream": stream})
        return hashed

    def _failing_save(self, tmp: str, phase):
        """Run a save phase; when it fails on any rank (a full disk, an I/O error), drop the torn ``tmp`` (its space
        back) and say that the last good checkpoint is kept and how to go on (docs/reliability.md)."""
        try:
            return phase()
        except CheckpointError as exc:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            done = store.list_checkpoints(self.root)
            kept = f"the last good checkpoint, {done[-1][1]}, is kept" if done else "no checkpoint was committed yet"
            full = "No space left" in str(exc) or "Disk quota" in str(exc)
            fix = (f"free space on {self.root} (or set checkpoint.dir elsewhere)" if full else "fix the cause")
            raise CheckpointError(f"{exc}; {kept}: {fix}, then continue with `accum-sched run CONFIG --resume`") \
                from None

    def _manifest(self, step: int, engine_state: dict, reason: str, partial_window: bool, stream: bool) -> Manifest:
        if self.parts["stream"] is not None:
            batches = 0  # a stream's epoch has no length known in advance
        else:
            batches = self._epoch_batches if self._epoch_batches is not None else len(self._loader)
        return Manifest(
            step=step, epoch=engine_state["epoch_index"], micro_batch=engine_state["micro_in_epoch"],
            batches_per_epoch=batches,
            world_size=self.world, factor_scale=self.plan.scale, micro_batch_size=self.cfg.data.micro_batch_size,
            config_hash=self.hash, config=store.training_config(self.cfg), reason=reason,
            backend=self.parts["backend"].name, sharded=self.parts["backend"].sharded_checkpoint,
            skipped_steps=self.engine.skipped_steps,
            created=time.time(), partial_window=partial_window, stream=stream)

    def _make_tmp(self, tmp: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        if os.path.exists(tmp):  # left by a save that died half way
            shutil.rmtree(tmp)
        os.makedirs(tmp)

    @staticmethod
    def _write_file(path: str, state: dict) -> dict:
        """torch.save ``state`` to ``path``, hashed on the way; returns its manifest entry."""
        with store.HashingFile(path) as f:
            torch.save(state, f)
        return f.entry

    def _state(self, engine_state: dict) -> dict:
        """trainer.pt's content but the RNG states: the engine's position, its parts' states (launcher/checkpoint/
        parts.py), references to the live tensors (a background save copies them first)."""
        engine = self.engine
        state = {
            "format": store.FORMAT, "engine": engine_state,
            "last_step": None if engine.last_step is None else engine.last_step.to_dict(),
            "config_hash": self.hash,
        }
        position = invariant_position(invariant_sampler(self.parts["sampler"]), engine.epoch_index,
                                      engine.micro_in_epoch, engine.window_open)
        if position is not None:
            state["invariant_position"] = position
        if self._order is not None and self._order[0] == engine.epoch_index:
            state["epoch_order"] = {"epoch": self._order[0], "indices": torch.tensor(self._order[1])}
        state.update(save_parts(self.parts))
        return state

    def _write_state(self, path: str, state: dict, rngs: list) -> dict:
        return self._write_file(path, {**state, "rng": rngs})
