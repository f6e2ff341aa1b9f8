"""DistributedDataParallel (``distributed.backend: ddp``, the default).

Every rank holds the whole model and optimizer, so checkpoints and model.pt are the single-process ones
(launcher/backends/single.py); on a world of one there is no wrapper at all.
"""
from __future__ import annotations

from launcher.backends.base import OptimizerFactory, Setup
from launcher.backends.single import SingleProcessBackend


class DDPBackend(SingleProcessBackend):
    """The model wrapped in DistributedDataParallel on more than one rank; the engine drives its gradient sync."""

    name = "ddp"
    invariant_sampler = True  # DDP and one process: tests/launcher/train/test_invariant_run.py

    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        setup = super().setup(cfg, model, make_optimizer, device, world)
        if world > 1:
            # torch on the worker only: config validation imports this module on login nodes
            from torch.nn.parallel import DistributedDataParallel

            from accum_sched.backends.ddp import DDPBackend as LibraryDDP  # torch: workers only

            setup.module = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=cfg.distributed.find_unused_parameters)
            setup.engine_args["backend"] = LibraryDDP(setup.module, setup.optimizer, setup.lr_scheduler,
                                                      precision=cfg.run.precision)
        return setup
