"""The launcher side of tests/minimal_backend.py: ``distributed.backend: minimal``, its section ``distributed.minimal``.

A back end added from outside the launcher with its module and one line in ``launcher.backends._BACKENDS``
(tests/launcher/backends/test_added_backend_run.py registers it and trains it through `accum-sched run`). One
process, the model unwrapped, checkpoints in trainer.pt (no shards of its own).

Torch-free at import: config validation imports this on the login-node path.
"""
from __future__ import annotations

from launcher.backends.base import LauncherBackend, OptimizerFactory, Setup
from launcher.errors import ConfigError
from launcher.options import Section, key, section


def positive_number(value) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


@section(path="distributed.minimal")
class MinimalOptions(Section):
    lr_multiplier: float = key(1.0, train=True, check=positive_number, hint="write a number > 0, e.g. 2.5",
                               doc="the window's gradient is multiplied by it before the optimizer steps")


class MinimalLauncherBackend(LauncherBackend):
    name = "minimal"
    options = {"minimal": (MinimalOptions, key(MinimalOptions, train=True,
                                               doc="the minimal back end's options (`backend: minimal`)"))}

    def validate(self, cfg) -> None:
        if cfg.run.precision != "fp32":
            raise ConfigError("run.precision", f"is {cfg.run.precision!r}; the minimal back end trains in fp32 only",
                              "set run.precision: fp32")

    def validate_unused(self, cfg) -> None:
        if cfg.distributed.minimal.to_dict() != MinimalOptions().to_dict():
            raise ConfigError("distributed.minimal", f"is set but distributed.backend is {cfg.distributed.backend}",
                              "set distributed.backend: minimal, or remove distributed.minimal")

    def preflight(self, cfg) -> None:
        if cfg.world_size != 1:
            raise ConfigError("distributed.nproc_per_node", f"gives {cfg.world_size} workers; the minimal back end "
                              "runs one process", "set distributed.nproc_per_node: 1 and distributed.nnodes: 1")

    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        from minimal_backend import MinimalBackend  # imports torch: workers only, never the config side

        optimizer, lr_scheduler = make_optimizer(model)
        setup = Setup(module=model, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
        setup.engine_args["backend"] = MinimalBackend(model, optimizer, lr_scheduler,
                                                      lr_multiplier=cfg.distributed.minimal.lr_multiplier)
        return setup

    def final_state_dict(self, setup: Setup, rank: int) -> dict | None:
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in setup.model.state_dict().items()}
