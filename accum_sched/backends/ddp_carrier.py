"""A DDP model whose window numbers ride in DDP's own reduction, with no comm hook: :func:`wrap_ddp`.

The engine's comm hook (:mod:`.ddp_hook`) carries the window's numbers in a bucket without a collective of their
own, but it is Python: torch hands each bucket's result back through a Python callback on the process group's
thread, one per bucket per step. :func:`wrap_ddp` instead gives the model one more parameter,
:attr:`WindowCarrier.window`, of :data:`accum_sched.window_stats.SIZE` elements, which DDP reduces with the model's
gradients in its C++ reducer. At the window's last backward the engine adds ``sum(window * numbers)`` to the loss:
the gradient of that parameter is then exactly this rank's numbers (the loss's own gradient is untouched), and DDP
returns their mean over ranks in ``window.grad``. Non-boundary micro-batches run under ``no_sync()`` and leave the
parameter alone. Measured on two CPU ranks (docs/performance.md), a step costs the same as on the hook: no Python
on the communication thread, but DDP's own reduction and the carrier's few tensor operations instead.

What it asks of the caller: the engine makes every synchronised backward (``find_unused_parameters=False``, so
DDP expects a gradient for every parameter in each one), and the model is built with :func:`wrap_ddp` before DDP
broadcasts it. The wrapped module keeps its own ``state_dict``: the carrier is a parameter of the wrapper only.
"""
from __future__ import annotations

import torch

from accum_sched import window_stats
from accum_sched.backends.base import module_device


class WindowCarrier(torch.nn.Module):
    """``module`` plus the parameter that carries the window's numbers; ``forward`` is the module's."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        # fp32 whatever the model's dtype: the numbers' digits are exact in fp32 (accum_sched.window_stats)
        self.window = torch.nn.Parameter(torch.zeros(window_stats.SIZE, dtype=torch.float32,
                                                     device=module_device(module)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def wrap_ddp(module: torch.nn.Module, **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(WindowCarrier(module), **ddp_kwargs)``: a DDP model on which the engine needs no comm
    hook (see the module's docstring). ``find_unused_parameters=True`` and ``static_graph=True`` are refused."""
    for key in ("find_unused_parameters", "static_graph"):
        if ddp_kwargs.get(key):
            raise ValueError(f"wrap_ddp({key}=True) is not supported: the window's carrier parameter gets its gradient "
                             f"outside the module's forward; construct DistributedDataParallel yourself (the engine "
                             f"then uses its comm hook)")
    return torch.nn.parallel.DistributedDataParallel(WindowCarrier(module), **ddp_kwargs)


def carrier_of(model) -> torch.Tensor | None:
    """The carrier parameter of a :func:`wrap_ddp` model, else None."""
    inner = getattr(model, "module", None)
    return inner.window if isinstance(inner, WindowCarrier) else None


__all__ = ["WindowCarrier", "carrier_of", "wrap_ddp"]
