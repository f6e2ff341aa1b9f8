"""One process, no wrapper: the model trains as it is (``distributed.backend: ddp`` on a world of one).

The AccumulationEngine drives the bare module; trainer.pt holds the model and optimizer; model.pt is the model's
own state_dict. launcher/backends/ddp.py adds the DDP wrapper for more ranks and keeps the rest.

``run.compile``: the whole model's forward is compiled in place (launcher/backends/compile.py) before anything wraps
it, so its state_dict keys, checkpoints and model.pt are those of the eager model.
"""
from __future__ import annotations

from launcher.backends.base import LauncherBackend, OptimizerFactory, Setup
from launcher.backends.compile import compile_modules
from launcher.backends.compile import options as compile_options


class SingleProcessBackend(LauncherBackend):
    """The model unwrapped; checkpoints and model.pt hold its plain state_dict (written by rank 0)."""

    name = "single"  # not a config value: what ``ddp`` is on one rank

    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        compile_modules([model], compile_options(cfg.run.compile))  # in place, before the DDP wrap (ddp.py)
        optimizer, lr_scheduler = make_optimizer(model)  # the module itself: no_decay matches its names
        setup = Setup(module=model, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
        if world == 1:  # on more ranks launcher/backends/ddp.py wraps the model and builds the DDP back end
            from accum_sched.backends import single as library  # torch: workers only, never the config side

            setup.engine_args["backend"] = library.SingleProcessBackend(model, optimizer, lr_scheduler,
                                                                        precision=cfg.run.precision)
        return setup

    def final_state_dict(self, setup: Setup, rank: int) -> dict | None:
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in setup.model.state_dict().items()}
