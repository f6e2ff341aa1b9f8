"""The workers' Checkpointer: save at optimizer-step boundaries, resume at the exact micro-batch.

What a checkpoint holds (``trainer.pt``, written by rank 0, loadable with ``torch.load(weights_only=True)``: only
tensors and plain Python values): model, optimizer, LR scheduler, GradScaler, ``engine.state_dict()`` (epoch,
micro-batch within it, counters), the sampler epoch, the last StepInfo, and every rank's RNG states (torch, numpy,
python, CUDA), gathered to rank 0 so one file holds them all. A back end with a sharded checkpoint writes its own
files into the same directory (``trainer.backend.save_shards``: DeepSpeed's per-rank files under ``deepspeed/``,
FSDP2's DCP shards under ``fsdp/``; launcher/backends/); ``trainer.pt`` then holds no model or optimizer.

When: at every epoch end, every ``checkpoint.every_n_steps`` optimizer steps (from the engine's on_step
callback), and where ``engine.should_stop`` turns True (preemption). The last may be inside a window (the engine's
stop_at="micro_batch"): then every rank also writes ``window-rank<R>.pt``, its accumulated local gradient and its
share of the window's counts, and the resume continues that window.

Resume loads nothing already trained: the DataLoader's sampler starts at the resume point
(accum_sched.ResumeSampler, the engine told skip=False), and the RNG is put back so that what the resumed run draws
equals what the uninterrupted run drew (see `_EpochLoader`).
On another world size (checkpoint.on_world_change) the rest of an interrupted epoch is re-dealt over the new ranks
in the same global order, so every sample of that epoch is still trained exactly once.

Collective: every method that saves or restores must be called on every rank at the same point.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from accum_sched.resume import ResumeSampler
from launcher.checkpoint import store
from launcher.train import coordination
from launcher.errors import ConfigError

class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, another config, another world size): raised on every rank."""


# -- RNG --------------------------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict:
    """This process's RNG states as tensors and plain values (safe for weights_only loading)."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank(seed: int, rank: int, step: int, device: torch.device) -> None:
    """A rank that has no saved RNG state (the world grew): a stream of its own, derived from seed, rank, step."""
    value = (seed * 1_000_003 + rank * 7919 + step) % 2**63
    random.seed(value)
    torch.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    try:
        import numpy as np

        np.random.seed(value % 2**32)
    except ImportError:
        pass


def own_optimizer_state(optimizer) -> None:
    """Give the optimizer private copies of host tensors it took over from an mmap-loaded checkpoint.

    ``optimizer.load_state_dict`` keeps a loaded tensor as it is when dtype and device already match (CPU
    training), so its state would stay backed by trainer.pt's pages; a state entry that is never updated in place
    (a parameter without a gradient) would then read a file that rotation, maybe on another node, deletes. State
    moved to a GPU is a copy already."""
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                entry[key] = value.clone()


# -- the sample order of one epoch ------------------------------------------------------------------------------
def global_order(dataset, epoch: int, world: int, shuffle: bool, seed: int) -> list[int]:
    """The epoch's samples as DistributedSampler deals them over ``world`` ranks, read rank-interleaved: position
    j of rank r is global position j*world + r, so the first k micro-batches of every rank are a prefix."""
    shards = []
    for r in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=shuffle, seed=seed, drop_last=False)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


def deal(order: list[int], world: int, rank: int) -> list[int]:
    """This rank's share of ``order``, padded like DistributedSampler so every rank gets as many samples."""
    if not order:
        return []
    padded = list(order)
    while len(padded) % world:
        padded += order[: world - len(padded) % world]
    return padded[rank::world]


class _EpochLoader:
    """The loader the engine sees for one epoch, positioned at the resume point (the engine runs it with
    skip=False): len() counts the micro-batches left, iter() loads only those.

    The DataLoader draws its base seed from the global torch RNG when its iterator is made, so the RNG state just
    before ``iter()`` is recorded: a checkpoint mid-epoch saves it with the current one. Resuming mid-epoch puts
    the epoch-start state back before ``iter()`` (the same base seed, so the same worker seeds) and the checkpoint's
    state right after it, before the first micro-batch not trained yet is fetched.
    """

    def __init__(self, owner: "Checkpointer", loader, start: int = 0, state: dict | None = None):
        self.owner, self.loader, self.start, self.state = owner, loader, start, state
        self.positioned = isinstance(getattr(loader, "sampler", None), ResumeSampler)
        if self.positioned:
            loader.sampler.start_at(start * loader.batch_size)

    def __len__(self) -> int:
        return len(self.loader) if self.positioned else max(0, len(self.loader) - self.start)

    def __iter__(self):
        self.owner._apply_pending_rng()
        self.owner._epoch_start_rng = rng_state(self.owner.device)
        self.owner._epoch_batches = self.start + len(self)
        iterator = iter(self.loader)
        if not self.positioned:  # a loader without ResumeSampler: position it the slow way, loading what it skips
            for _ in range(self.start):
                next(iterator)
        if self.state is not None:
            set_rng_state(self.state, self.owner.device)
        return iterator


class Checkpointer:
    """Saves and restores one rank's training state. Built by the Trainer before its schedule (the resume point
    decides a rescaled schedule on a world-size change); ``restore(trainer)`` before training.

    ``resume`` is None (start afresh: checkpoints of an earlier run in the folder are moved aside), ``"auto"`` or a
    path. A restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) or a requeued SLURM job (SLURM_RESTART_COUNT
    > 0) resumes from the newest valid checkpoint by itself, falling back to ``resume`` when the failed attempt
    had not saved one yet.
    """

    def __init__(self, cfg, rank: int, world: int, resume: str | None = None, device=None, group=None):
        self.cfg, self.rank, self.world = cfg, rank, world
        # every collective below runs on the gloo coordination group (launcher/train/coordination.py), not the default one
        self.group = group if group is not None else coordination.group()
        self.device = device or torch.device("cpu")
        self.root = os.path.abspath(store.checkpoint_root(cfg))
        self.every = cfg.checkpoint.every_n_steps
        self.keep = cfg.checkpoint.keep_last
        self.hash = store.config_hash(cfg)
        self.trainer = None
        # a restart of torchrun's worker group, or of a requeued SLURM job: both continue from the newest checkpoint
        self.restarts = sum(int(os.environ.get(name, "0") or 0)
                            for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        self.fresh = resume is None and self.restarts == 0
        self.found = None if self.fresh else self._on_rank0(lambda: self._locate(resume))
        self.scale = (1, 1)
        self.diffs: list = []
        if self.found is not None:
            path, manifest = self.found
            self._together(f"resuming from {path}", lambda: self._must_see(path, store.MANIFEST))
            self.diffs = self._on_rank0(lambda: store.check_config(path, manifest, cfg))
            self.scale = self._on_rank0(lambda: store.factor_scale(dict(manifest, name=path), cfg, world))
        self._last_saved: str | None = None  # path of the newest checkpoint of this position
        self._epoch_start_rng: dict | None = None
        self._epoch_batches: int | None = None
        self._pending_rng = None  # applied at the next epoch's iter(): a state dict, or a step to seed from
        self._replay: tuple[int, dict] | None = None  # (epoch, RNG state) to put back at a mid-epoch resume point
        self._order: tuple[int, list[int]] | None = None  # (epoch, global sample order) re-dealt after a world change
        self._order_loader = None

    # -- collectives --------------------------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world > 1

    def _on_rank0(self, fn):
        """Rank 0 decides (reads the disk), every rank gets the same answer or raises the same error."""
        result = error = None
        if self.rank == 0:
            try:
                result = fn()
            except ConfigError as exc:
                error = exc.line()
            except Exception as exc:  # noqa: BLE001 -- the other ranks must not wait for an answer forever
                error = f"{type(exc).__name__}: {exc}"
        if self._distributed():
            box = [result, error]
            dist.broadcast_object_list(box, src=0, group=self.group)
            result, error = box
        if error:
            raise CheckpointError(error)
        return result

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self.group)

    def _say(self, text: str, stream=None) -> None:
        if self.rank == 0:
            print(f"accum-sched: {text}", file=stream or sys.stdout, flush=True)

    # -- where to resume from ------------------------------------------------------------------------------------
    def _locate(self, resume: str | None):
        report = lambda problem: self._say(problem, sys.stderr)  # noqa: E731
        if self.restarts > 0:
            found = store.find(self.root, "auto", report)
            if found is not None or resume in (None, "auto"):
                return found
        found = store.find(self.root, resume, report)
        if found is None:
            self._say(f"--resume auto: no checkpoint in {self.root} yet; starting afresh")
        return found

    def schedule(self, config_schedule):
        """The schedule to train with: the config's, rescaled when a world-size change keeps the global batch."""
        if self.scale == (1, 1):
            return config_schedule
        from accum_sched import AccumulationSchedule

        return AccumulationSchedule(store.scaled_milestones(config_schedule.milestones, self.scale),
                                    config_schedule.unit)

    # -- resume -------------------------------------------------------------------------------------------------
    def restore(self, trainer) -> int:
        """Attach to ``trainer`` and load the checkpoint found at construction, if any. Returns its step (0 if
        none). Rank 0 also cuts metrics.jsonl back to that step and sets newer checkpoints aside."""
        self.trainer = trainer
        if self.found is None:
            self._start_afresh(trainer.run_dir)
            return 0
        path, manifest = self.found
        for field, old, new in self.diffs:
            self._say(f"warning: checkpoint.force_resume: {field} was {old!r} in the checkpoint, now {new!r}",
                      sys.stderr)
        state = self._load(os.path.join(path, store.STATE))
        self._load_model(trainer, state, path)
        engine_state = self._resume_position(dict(state["engine"]), state.get("epoch_order"), manifest)
        if manifest.get("partial_window"):
            engine_state["window"] = self._load(os.path.join(path, f"window-rank{self.rank}.pt"))["window"]
        self._load_engine(trainer, state, engine_state)
        step = int(engine_state["optimizer_steps"])
        self._plan_rng(state["rng"], engine_state, manifest)
        self._last_saved = store.step_dir(self.root, step, engine_state["micro_batch"]
                                          if manifest.get("partial_window") else None)
        if self.rank == 0:
            self._tidy_after_resume(trainer.run_dir, path, step)
            self._say(f"resumed from {path} (step {step}, {self._where(manifest)}; saved by "
                      f"{manifest['world_size']} workers)")
        self._barrier()
        return step

    def _start_afresh(self, run_dir: str) -> None:
        """No checkpoint to resume: rank 0 moves an earlier run's checkpoints aside and empties metrics.jsonl."""
        if self.rank != 0:
            return
        moved = store.supersede(self.root) if self.fresh else None
        if moved is not None:
            aside, old = moved
            self._say(f"starting afresh: moved {len(old)} checkpoint(s) of an earlier run to {aside} "
                      f"(run with --resume to continue a run; delete that folder when not needed)", sys.stderr)
        store.truncate_metrics(run_dir, 0)

    def _resume_position(self, engine_state: dict, order, manifest: dict) -> dict:
        """The engine position to continue from. On another world size an epoch interrupted mid-way is re-dealt:
        its samples not trained yet, in the same global order, over the new ranks (self._order)."""
        epoch, micro = int(engine_state["epoch"]), int(engine_state["micro_batch"])
        batches, old_world = int(manifest["batches_per_epoch"]), int(manifest["world_size"])
        if old_world != self.world and micro > 0:
            if micro >= batches:  # the epoch was complete: continue with the next one
                engine_state["epoch"], engine_state["micro_batch"] = epoch + 1, 0
            else:
                if order is None or int(order["epoch"]) != epoch:
                    full = global_order(self.trainer.task.dataset, epoch, old_world, self.cfg.data.shuffle,
                                        self.cfg.run.seed)
                else:
                    full = order["indices"].tolist()
                self._order = (epoch, full[old_world * micro * self.cfg.data.micro_batch_size:])
                engine_state["micro_batch"] = 0
        elif order is not None and int(order["epoch"]) == epoch:
            self._order = (epoch, order["indices"].tolist())  # a re-dealt epoch, resumed on the same world
        return engine_state

    def _load_engine(self, trainer, state: dict, engine_state: dict) -> None:
        trainer.engine.load_state_dict(engine_state)
        if state.get("last_step"):
            from accum_sched.engine import StepInfo

            trainer.engine.last_step = StepInfo.from_dict(state["last_step"])  # flat metrics line -> StepInfo
        trainer.sampler.set_epoch(int(state["sampler_epoch"]))
        if getattr(trainer, "validation", None) is not None:
            trainer.validation.load_state_dict(state.get("eval"))

    def _plan_rng(self, saved: list, engine_state: dict, manifest: dict) -> None:
        """What RNG state this rank starts from: its own saved one (mid-epoch: the epoch-start state before the
        loader's iter(), then the saved one), or a fresh stream when the world grew and it has none."""
        mine = saved[self.rank] if self.rank < len(saved) else None
        epoch, micro = int(engine_state["epoch"]), int(engine_state["micro_batch"])
        same_world = int(manifest["world_size"]) == self.world
        if mine is None:
            self._pending_rng = int(engine_state["optimizer_steps"])
        elif same_world and 0 < micro < int(manifest["batches_per_epoch"]) and mine.get("epoch_start") is not None:
            self._pending_rng = mine["epoch_start"]
            self._replay = (epoch, mine["now"])
        else:
            self._pending_rng = mine["now"]

    def _tidy_after_resume(self, run_dir: str, path: str, step: int) -> None:
        """Rank 0: checkpoints after the one resumed are a future that did not happen (damaged, or the user resumed
        an older one): set them aside; metrics.jsonl is cut back to ``step``."""
        mine = store.checkpoint_key(path)
        for _, p in store.list_checkpoints(self.root):
            if store.checkpoint_key(p) > mine:
                self._say(f"set aside {p} -> {store.set_aside(p)}", sys.stderr)
        store.truncate_metrics(run_dir, step)

    def _where(self, manifest: dict) -> str:
        engine = self.trainer.engine
        if self._order is not None and int(manifest["world_size"]) != self.world:
            return f"epoch {self._order[0]}: the {len(self._order[1])} samples not trained yet, re-dealt"
        where = f"epoch {engine.epoch_index}, micro-batch {engine.micro_in_epoch}"
        return where + (" inside a window" if engine.window_open else "")

    def _load(self, path: str) -> dict:
        # Only what we wrote ourselves is loaded here, with weights_only (tensors and plain values); DeepSpeed's
        # own shards are loaded by DeepSpeed's load_checkpoint (_load_model), under its own rules.
        try:
            # mmap: tensors stay file-backed pages (shared through the page cache by the ranks of a node) until
            # load_state_dict copies them into place, instead of one private copy of the whole file per rank
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # checksums passed, so this is a format problem: name the file
            raise CheckpointError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from exc

    def _load_model(self, trainer, state: dict, path: str) -> None:
        if trainer.backend.sharded_checkpoint:  # DeepSpeed / FSDP2 read their own files (collective)
            trainer.backend.load_shards(trainer.setup, path)
        else:
            trainer.model.load_state_dict(state["model"])
            trainer.optimizer.load_state_dict(state["optimizer"])
            own_optimizer_state(trainer.optimizer)
        if trainer.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])  # also when DeepSpeed does not own it
        scaler = getattr(trainer.engine.backend, "scaler", None)
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])

    def _apply_pending_rng(self) -> None:
        pending, self._pending_rng = self._pending_rng, None
        if isinstance(pending, dict):
            set_rng_state(pending, self.device)
        elif pending is not None:
            seed_rank(self.cfg.run.seed, self.rank, pending, self.device)

    def loader(self, epoch: int, loader):
        """What the engine should iterate in ``epoch`` (with skip=False): ``loader`` positioned at the resume point
        and wrapped to track the RNG, or the re-dealt rest of an epoch interrupted on another world size."""
        if self._order is not None and self._order[0] == epoch:
            if self._order_loader is None:
                share = deal(self._order[1], self.world, self.rank)
                self._order_loader = DataLoader(
                    loader.dataset, batch_size=loader.batch_size, sampler=ResumeSampler(share),
                    drop_last=loader.drop_last, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                    pin_memory=loader.pin_memory)
            loader = self._order_loader
        start = self.trainer.engine.resume_offset(epoch)
        state = None
        if self._replay is not None and self._replay[0] == epoch:
            state = self._replay[1]
            self._replay = None
        return _EpochLoader(self, loader, start, state)

    # -- save ---------------------------------------------------------------------------------------------------
    def on_step(self, info) -> None:
        """engine.on_step callback: every ``every_n_steps`` steps, and when the ranks agreed to stop."""
        if (self.every and info.step % self.every == 0) or self.trainer.engine.should_stop:
            self.save("stop" if self.trainer.engine.should_stop else "step")

    def epoch_end(self) -> None:
        self.save("epoch")

    def save_now(self, reason: str = "request") -> str:
        """Save at the current optimizer boundary (e.g. preemption, once ``engine.should_stop`` is True) and return
        the checkpoint's path. Collective. If this step is saved already (on_step saves at the stop step by itself)
        it only returns that checkpoint's path."""
        return self.save(reason)

    def save(self, reason: str) -> str:
        trainer, engine = self.trainer, self.trainer.engine
        step = engine.optimizer_steps
        final = store.step_dir(self.root, step, engine.micro_in_epoch if engine.window_open else None)
        if final == self._last_saved:
            return final
        tmp = final + ".tmp"
        # Three phases, each closed by a gather of every rank's error (if any): a rank that fails to write makes
        # all of them raise at once instead of leaving the others waiting in a barrier until the timeout.
        self._together(f"preparing {tmp}", lambda: self._make_tmp(tmp) if self.rank == 0 else None)
        # every rank sees what rank 0 made (else DeepSpeed shards land on a node's own disk), checked before any rank
        # enters DeepSpeed's collective save, which a rank that stopped alone would leave hanging
        self._together(f"preparing {tmp}", lambda: self._must_see(tmp))
        mine = {"now": rng_state(self.device), "epoch_start": self._epoch_start_rng}
        rngs = [None] * self.world
        if self._distributed():
            dist.all_gather_object(rngs, mine, group=self.group)
        else:
            rngs = [mine]
        engine_state = engine.state_dict()
        window = engine_state.pop("window", None)  # this rank's open window (a stop inside it): per rank

        def write():
            hashed = {}  # what we write is hashed while it is written: no second read at commit
            if trainer.backend.sharded_checkpoint:  # collective: every rank writes its shards (DeepSpeed, FSDP2)
                trainer.backend.save_shards(trainer.setup, tmp)
            if window is not None:
                rel = f"window-rank{self.rank}.pt"
                hashed[rel] = self._write_file(os.path.join(tmp, rel), {"format": store.FORMAT, "rank": self.rank,
                                                                         "window": window})
            if self.rank == 0:
                hashed[store.STATE] = self._write_state(os.path.join(tmp, store.STATE), engine_state, rngs)
            return hashed

        hashed = {}
        for entries in self._together(f"writing {tmp}", write):
            hashed.update(entries or {})

        def commit():
            if self.rank != 0:
                return
            manifest = {
                "format": store.FORMAT, "step": step, "epoch": engine_state["epoch"],
                "micro_batch": engine_state["micro_batch"],
                "batches_per_epoch": self._epoch_batches if self._epoch_batches is not None else len(trainer.loader),
                "world_size": self.world, "factor_scale": list(self.scale),
                "micro_batch_size": self.cfg.data.micro_batch_size, "config_hash": self.hash,
                "config": store.training_config(self.cfg), "reason": reason, **trainer.backend.manifest_entries(),
                "skipped_steps": engine.skipped_steps, "created": time.time(),
                "partial_window": window is not None,
            }
            store.commit(tmp, final, manifest, hashed)
            store.rotate(self.root, self.keep)

        self._together(f"committing {final}", commit)
        self._last_saved = final
        return final

    def _must_see(self, path: str, name: str | None = None) -> None:
        """Raise unless this rank sees ``path`` (a directory rank 0 chose or made), and ``name`` in it.

        Rank 0 alone picks the checkpoint to resume and makes the directory a save writes into; every rank then reads
        (resume) or writes (DeepSpeed shards) there, which needs one file system shared by every node."""
        target = path if name is None else os.path.join(path, name)
        if not (os.path.isdir(path) and (name is None or os.path.exists(target))):
            raise CheckpointError(f"{target} (chosen by rank 0) is not visible on host {socket.gethostname()}: "
                                  f"checkpoint.dir must be on a file system shared by every node "
                                  f"(set checkpoint.dir to such a path)")

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

    def _write_state(self, path: str, engine_state: dict, rngs: list) -> dict:
        trainer, engine = self.trainer, self.trainer.engine
        state = {
            "format": store.FORMAT, "engine": engine_state, "sampler_epoch": int(trainer.sampler.epoch),
            "last_step": None if engine.last_step is None else engine.last_step.to_dict(), "rng": rngs,
            "config_hash": self.hash,
            "lr_scheduler": None if trainer.lr_scheduler is None else trainer.lr_scheduler.state_dict(),
        }
        validation = getattr(trainer, "validation", None)
        if validation is not None:  # best value and early-stop count (launcher/train/validation.py)
            state["eval"] = validation.state_dict()
        if self._order is not None and self._order[0] == engine.epoch_index:
            state["epoch_order"] = {"epoch": self._order[0], "indices": torch.tensor(self._order[1])}
        if not trainer.backend.sharded_checkpoint:  # DeepSpeed / FSDP2 keep sharded files of their own
            scaler = getattr(engine.backend, "scaler", None)
            state.update(model=trainer.model.state_dict(), optimizer=trainer.optimizer.state_dict(),
                         scaler=None if scaler is None else scaler.state_dict())
        return self._write_file(path, state)

    def _together(self, what: str, fn) -> list:
        """Run ``fn`` on this rank, then raise on every rank if it failed on any (doubles as a barrier). Returns
        every rank's result (small: they travel in the same gather as the errors)."""
        result = error = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 -- reported on every rank below
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        gathered = [(error, result)]
        if self._distributed():
            gathered = [None] * self.world
            dist.all_gather_object(gathered, (error, result), group=self.group)
        failed = [e for e, _ in gathered if e]
        if failed:
            raise CheckpointError(f"checkpoint {what} failed: {'; '.join(failed)}")
        return [r for _, r in gathered]
