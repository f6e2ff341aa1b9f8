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


def scaled_lr(optimizer, scale):
    """Run the enclosed ``optimizer.step()`` at ``lr x scale`` (LR coupling), restoring every group's LR after, so the
    LR scheduler never sees the coupling. ``scale`` may also be an :class:`accum_sched.co_scale.GroupScale`, which
    changes beta2 and weight decay for the step as well. At scale 1 (no coupling: every step by default) a shared
    no-op context."""
    if not isinstance(scale, (int, float)):
        return _scaled_groups(optimizer, scale)
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


@contextlib.contextmanager
def _scaled_groups(optimizer, scale):
    keys = ("lr", "betas", "weight_decay")
    saved = [{k: group[k] for k in keys if k in group} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale.lr
        if scale.beta2_power is not None:
            beta1, beta2 = group["betas"]
            group["betas"] = (beta1, beta2 ** scale.beta2_power)
        if scale.weight_decay is not None:
            group["weight_decay"] = group["weight_decay"] * scale.weight_decay
    try:
        yield
    finally:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)


def tensor_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each of ``tensors`` (non-empty), in their order, as 0-d tensors taken in fp32 or better.

    One fused ``torch._foreach_norm`` pass (available since torch 2.0, unlike ``torch.nn.utils.get_total_norm``) over
    the fp32 and wider ones; fp16 and bf16 ones are accumulated in fp32 one by one. Each norm depends only on its
    tensor's values, not on where the tensor lies in memory, so a sum over them in a fixed order does not change
    with how the tensors are laid out (DDP's buckets are laid out again after the first iteration)."""
    low = [i for i, t in enumerate(tensors) if t.dtype in (torch.float16, torch.bfloat16)]
    wide = [i for i, t in enumerate(tensors) if t.dtype not in (torch.float16, torch.bfloat16)]
    norms: list = [None] * len(tensors)
    if wide:
        for i, norm in zip(wide, torch._foreach_norm([tensors[i] for i in wide], 2)):
            norms[i] = norm
    for i in low:
        norms[i] = torch.linalg.vector_norm(tensors[i], dtype=torch.float32)
    return norms


def squared_norm(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squares of every element of ``tensors``, as a float64 0-d tensor on ``device``, without a host sync.

    Each tensor's norm is taken in fp32 or better (:func:`tensor_norms`; fp32 rounding, ~1e-7 relative, is far below
    any tolerance, and a float64 pass is many times slower on CPU) and the squares are summed in float64.
    """
    tensors = [t for t in tensors if t is not None and t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = tensor_norms(tensors)
    target = device if device is not None else norms[0].device
    return torch.stack([n.to(target, torch.float64) for n in norms]).square().sum()
