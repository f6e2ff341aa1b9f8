"""One process: a plain module and a torch optimizer; nothing is reduced (the registry's last resort)."""
from __future__ import annotations

from accum_sched import collective
from accum_sched.backends.base import BackendOptions
from accum_sched.backends.detect import refuse_fsdp_submodules, refuse_gradient_sync
from accum_sched.backends.torch_optim import TorchBackend


class SingleProcessBackend(TorchBackend):
    """A plain ``nn.Module`` in one process (a group of more ranks is refused: its gradients would never meet)."""

    def __init__(self, model, optimizer, lr_scheduler=None, options: BackendOptions | None = None):
        options = options or BackendOptions()
        refuse_gradient_sync(options.gradient_sync)
        refuse_fsdp_submodules(model)
        if collective.world_size() > 1:
            raise ValueError(f"the process group has {collective.world_size()} ranks but the model is not wrapped in "
                             f"DistributedDataParallel, so gradients would never meet; wrap it: "
                             f"DistributedDataParallel(model)")
        super().__init__(model, optimizer, lr_scheduler, options)


__all__ = ["SingleProcessBackend"]
