"""The launcher's back-end seam: what `accum-sched` asks of ``distributed.backend`` (ddp, fsdp, deepspeed).

One object per back end (launcher/backends/__init__.py holds the registry). Every place in the launcher that
depends on the back end calls one method here instead of comparing ``cfg.distributed.backend`` with a name:

* config validation and ``accum-sched check`` (login nodes, no torch): :meth:`validate`,
  :meth:`validate_unused`, :meth:`resolve_raw`, :meth:`preflight`,
  :meth:`check_world_change`;
* the worker (torch imported): :meth:`setup` builds what the AccumulationEngine drives, :meth:`final_state_dict`
  gathers model.pt;
* the Checkpointer (torch imported, collective): :attr:`sharded_checkpoint`, :attr:`unpickled_files`,
  :meth:`save_shards`, :meth:`load_shards` (the manifest records :attr:`name` and :attr:`sharded_checkpoint`).

Why these and no more: each one replaces a branch the launcher had (config rules, the DeepSpeed JSON's schedule,
wrapping, the shard files of a checkpoint, the final gather). Everything else (the loop, metrics, evaluation,
resume positions, RNG) is the same for every back end and stays out of here.

This module and every back end's module import torch inside functions only: the config side runs without it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Setup:
    """What a back end built on one rank (:meth:`LauncherBackend.setup`).

    ``module``: handed to the AccumulationEngine and used for evaluation (DDP wrapper, DeepSpeed engine, FSDP2
    root or the bare model). ``model``: the underlying torch module (state_dict, checkpoints). ``optimizer`` and
    ``lr_scheduler``: as the back end holds them (DeepSpeed's may be its ZeRO optimizer and its own scheduler).
    ``engine_args``: the AccumulationEngine keywords the back end decides: ``backend``, the library back end it
    built with its own options (which holds the optimizer and LR scheduler it steps).
    """

    module: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    engine_args: dict = field(default_factory=dict)


# builds (optimizer, lr_scheduler) for a module: the back end decides when (FSDP2 shards the model first)
OptimizerFactory = Callable[[Any], "tuple[Any, Any]"]


class LauncherBackend(ABC):
    """One value of ``distributed.backend``. Stateless: one shared instance per back end."""

    name: ClassVar[str]  # the config value
    # True when the back end writes model and optimizer as files of its own inside a checkpoint directory
    # (save_shards / load_shards); trainer.pt then holds neither. False: trainer.pt holds both.
    sharded_checkpoint: ClassVar[bool] = False
    # The folder of a checkpoint whose files load_shards hands to a full unpickle (torch.load weights_only=False),
    # or None. The Checkpointer checks every pickle in it first (launcher/checkpoint/pickle_scan.py), on every rank,
    # so a planted import stops every rank alike with one line naming the file, before anything is unpickled.
    unpickled_files: ClassVar[str | None] = None
    # this back end's keys in the distributed section, ``{name: (annotation, launcher.options.key(...))}``
    # (``fsdp``, ``deepspeed_config``): declared in its module, composed into the config by the registry
    options: ClassVar[dict] = {}
    # whether ``data.sampler: invariant`` (short and empty micro-batches, run as zero-weighted fillers) is tested
    # with this back end; config validation refuses the pair otherwise
    invariant_sampler: ClassVar[bool] = False

    # -- config side: torch-free ------------------------------------------------------------------------------
    def validate(self, cfg) -> None:
        """The config rules of this back end when it is chosen; raise ConfigError naming the field.

        Called by launcher.config validation (login nodes, no torch) after the generic section checks."""

    def validate_unused(self, cfg) -> None:
        """The rules that hold while another back end is chosen (e.g. this back end's own options left at their
        defaults); raise ConfigError. Called by launcher.config validation, torch-free."""

    def resolve_raw(self, cfg) -> dict | None:
        """``cfg`` as a raw dict to validate again when the back end's own config changes it (DeepSpeed's JSON
        may carry the schedule), else None. Called by launcher.config validation, torch-free."""
        return None

    def preflight(self, cfg) -> None:
        """Checks that need the launch's world size (``cfg.world_size``) or files the back end reads; raise
        ConfigError. Called by `accum-sched check`, `run` and `slurm` before any worker starts, torch-free."""

    def check_world_change(self, what: str, old_world: int) -> None:
        """Raise ConfigError when a checkpoint of this back end cannot resume on another world size (``what``
        says which checkpoint and both sizes). Called before launch and on rank 0 of a resume, torch-free."""

    # -- worker side: torch ----------------------------------------------------------------------------------
    @abstractmethod
    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        """Wrap ``model`` (already on ``device``) for training on ``world`` ranks and build its optimizer and LR
        scheduler with ``make_optimizer(module)`` at the point the back end needs them. Called once by the
        Trainer on every rank, after the process group is up; may be collective."""

    @abstractmethod
    def final_state_dict(self, setup: Setup, rank: int) -> dict | None:
        """The trained model as a plain state_dict on rank 0 (None elsewhere), for model.pt and model-best.pt.
        Called on every rank at the same point (collective where the model is sharded)."""

    # -- checkpoints: torch, collective ----------------------------------------------------------------------
    def save_shards(self, setup: Setup, directory: str) -> None:
        """Write this rank's model and optimizer files into the checkpoint's temporary ``directory`` (only when
        :attr:`sharded_checkpoint`). Called by the Checkpointer on every rank at the same point."""

    def load_shards(self, setup: Setup, directory: str) -> None:
        """Read what :meth:`save_shards` wrote into the live model and optimizer; raise CheckpointError naming
        the checkpoint (only when :attr:`sharded_checkpoint`). Called by the Checkpointer on every rank."""
