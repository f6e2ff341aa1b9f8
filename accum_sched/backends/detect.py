"""Which back end a model needs, decided without importing what that back end would need.

A DeepSpeed engine is recognised by its type's name or a method of it (DeepSpeed is never imported here); FSDP2 only
through ``sys.modules``: if ``torch.distributed.fsdp`` was never imported, no model can be an FSDP2 one.
"""
from __future__ import annotations

import sys


def is_deepspeed_engine(model) -> bool:
    """True for a DeepSpeedEngine (recognised without importing DeepSpeed)."""
    return type(model).__name__ == "DeepSpeedEngine" or hasattr(model, "set_gradient_accumulation_boundary")


def fsdp_module_class():
    """torch's FSDPModule if FSDP2 is in use (its module imported); never imports it for DDP or one process."""
    module = sys.modules.get("torch.distributed.fsdp")
    return None if module is None else getattr(module, "FSDPModule", None)


def is_fsdp2_root(model) -> bool:
    """True for a module that ``fully_shard`` was applied to."""
    fsdp = fsdp_module_class()
    return fsdp is not None and isinstance(model, fsdp)


def is_ddp(model) -> bool:
    """True for a DistributedDataParallel module."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def refuse_fsdp_submodules(model) -> None:
    """A module whose blocks were sharded but not the module itself would train its shards unreduced: refuse it."""
    fsdp = fsdp_module_class()
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        raise ValueError("fully_shard was applied to submodules but not to the model handed to the engine; apply "
                         "it to the root too (fully_shard(model)) after its blocks")


__all__ = ["fsdp_module_class", "is_ddp", "is_deepspeed_engine", "is_fsdp2_root", "refuse_fsdp_submodules"]
