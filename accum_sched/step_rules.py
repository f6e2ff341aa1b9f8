"""Rules every back end applies at an optimizer step, written once: gradient scale with clipping, LR coupling, norm.

A back end (torch, DDP, DeepSpeed, FSDP2) differs in *where* the window's gradient lives; what it multiplies that
gradient by, how it scales the learning rate for one step and how it takes a norm are the same everywhere.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def gradient_scale(coef: float, max_norm: float | None, norm: float | None) -> float:
    """What to multiply the accumulated gradient by: the engine's normalisation ``coef``, times the clipping factor.

    ``norm`` is the global norm of the accumulated gradient *before* ``coef``; the clipped norm is that of the
    normalised gradient, with torch.nn.utils.clip_grad_norm_'s rule (``max_norm / (norm + 1e-6)``, capped at 1).
    """
    if max_norm is None:
        return coef
    if norm is None:
        raise ValueError("clipping needs the gradient norm of the window")
    return coef * min(1.0, max_norm / (norm * coef + 1e-6))


def scale_gradients(tensors: Sequence[torch.Tensor], scale: float) -> None:
    """Multiply ``tensors`` in place by ``scale`` in one fused pass; nothing at all when the scale is 1."""
    if tensors and scale != 1.0:
        torch._foreach_mul_(list(tensors), scale)


def scaled_lr(optimizer, scale: float):
    """Run the enclosed ``optimizer.step()`` at ``lr x scale`` (LR coupling), restoring every group's LR after, so the
    LR scheduler never sees the coupling. At scale 1 (no coupling: every step by default) a shared no-op context."""
    return NO_CONTEXT if scale == 1.0 else _scaled_lr(optimizer, scale)


NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing (a hot path's no-op context)


@contextlib.contextmanager
def _scaled_lr(optimizer, scale: float):
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def squared_norm(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squares of every element of ``tensors``, as a float64 0-d tensor on ``device``, without a host sync.

    One fused ``torch._foreach_norm`` pass (available since torch 2.0, unlike ``torch.nn.utils.get_total_norm``); each
    tensor's norm is taken in fp32 or better (fp32 rounding, ~1e-7 relative, is far below any tolerance, and a
    float64 pass is many times slower on CPU) and the squares are summed in float64.
    """
    tensors = [t for t in tensors if t is not None and t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    low = [t for t in tensors if t.dtype in (torch.float16, torch.bfloat16)]
    wide = [t for t in tensors if t.dtype not in (torch.float16, torch.bfloat16)]
    norms = list(torch._foreach_norm(wide, 2)) if wide else []
    norms += [torch.linalg.vector_norm(t, dtype=torch.float32) for t in low]  # fp32 accumulation for low precision
    target = device if device is not None else norms[0].device
    return torch.stack([n.to(target, torch.float64) for n in norms]).square().sum()
