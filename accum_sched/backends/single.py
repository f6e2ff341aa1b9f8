"""One process: a plain module and a torch optimizer; nothing is reduced (the registry's last resort)."""
from __future__ import annotations

from accum_sched import collective
from accum_sched.backends.detect import refuse_fsdp_submodules
from accum_sched.backends.torch_optim import TorchBackend


class SingleProcessBackend(TorchBackend):
    """A plain ``nn.Module`` in one process (a group of more ranks is refused: its gradients would never meet).

    ``count_allreduce`` is accepted for the same spelling as :class:`~accum_sched.backends.ddp.DDPBackend` (a model
    that is DDP on several ranks is a plain one on one); one process has no all-reduce to count."""

    def __init__(self, model, optimizer, lr_scheduler=None, *, precision: str = "fp32", count_allreduce: bool = True):
        refuse_fsdp_submodules(model)
        if collective.world_size() > 1:
            raise ValueError(f"the process group has {collective.world_size()} ranks but the model is not wrapped in "
                             f"DistributedDataParallel, so gradients would never meet; wrap it: "
                             f"DistributedDataParallel(model)")
        super().__init__(model, optimizer, lr_scheduler, precision=precision)


__all__ = ["SingleProcessBackend"]
