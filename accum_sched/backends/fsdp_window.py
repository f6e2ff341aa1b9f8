"""An open window under FSDP2: this rank's accumulated gradient, saved and put back (a stop inside a window).

Where FSDP2 keeps a window's gradient between micro-batches, per parameter (``FSDPParam``) of the optimizer:

* ``gradient_sync: boundary`` (no reduce-scatter off the boundary): the *unsharded* gradient this rank accumulated,
  in ``FSDPParam.unsharded_accumulated_grad`` where a ``MixedPrecisionPolicy.reduce_dtype`` differs from the
  parameter dtype, else in ``.grad`` of the unsharded parameter (which outlives the reshard after backward);
* ``every_micro_batch`` (and ``reduce_scatter`` on a 1-D mesh): the reduced *shard* in the sharded DTensor
  parameter's ``.grad`` (its ``to_local()``);
* ``reduce_scatter`` under HSDP: the reduce-scattered, not yet all-reduced, shard sum of each parameter group
  (``FSDPParamGroup._partial_reduce_output``).

All three are this rank's own data (the unsharded sum differs per rank, the shards are this rank's), so they are
saved per rank, as plain CPU tensors, in the engine's window state (the launcher's ``window-rank<R>.pt``), and put
back into the same places on resume; the next micro-batches accumulate into them exactly as they would have. A
per-rank file rather than DCP: nothing here is resharded (another world size is refused for an open window), and the
unsharded sums are not shards of one global tensor that DCP could describe.

Putting an unsharded gradient back needs FSDP2's unsharded parameter, which exists only after a first all-gather:
``load`` unshards every FSDP2 module once (a collective: every rank loads its window at the same point of the
resume) and reshards it, leaving the gradient on the unsharded parameter as a no-sync backward would have.
"""
from __future__ import annotations

import torch

FORMAT = "fsdp2-window-1"


def _param_groups(modules) -> list:
    """Every FSDPParamGroup of the FSDP2 ``modules``, in module order (the same on every rank)."""
    out = []
    for module in modules:
        out.extend(g for g in module._get_fsdp_state()._fsdp_param_groups if g is not None)
    return out


def _fsdp_params(modules) -> dict:
    """id(sharded parameter) -> its FSDPParam."""
    return {id(fp.sharded_param): fp for group in _param_groups(modules) for fp in group.fsdp_params}


def _optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _unsharded_grad(fp) -> tuple[torch.Tensor | None, bool]:
    """(this rank's unsharded accumulated gradient of ``fp`` or None, whether it is the reduce-dtype copy)."""
    if getattr(fp, "unsharded_accumulated_grad", None) is not None:
        return fp.unsharded_accumulated_grad, True
    unsharded = getattr(fp, "_unsharded_param", None)
    if unsharded is not None and unsharded.grad is not None:
        return unsharded.grad, False
    return None, False


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def save(modules, optimizer) -> dict:
    """This rank's open window under FSDP2, as CPU tensors (see the module docstring)."""
    by_id = _fsdp_params(modules)
    params = []
    for p in _optimizer_params(optimizer):
        fp = by_id.get(id(p))
        unsharded, accumulated = _unsharded_grad(fp) if fp is not None else (None, False)
        params.append({"unsharded": _cpu(unsharded), "accumulated": accumulated,
                       "sharded": None if p.grad is None else _cpu(_local(p.grad))})
    partial = [_cpu(getattr(g, "_partial_reduce_output", None)) for g in _param_groups(modules)]
    return {"format": FORMAT, "params": params, "partial": partial}


def tensors(modules, optimizer) -> list[torch.Tensor]:
    """The open window's gradients in place (scaling them scales the window's gradient)."""
    by_id = _fsdp_params(modules)
    out = []
    for p in _optimizer_params(optimizer):
        fp = by_id.get(id(p))
        unsharded = _unsharded_grad(fp)[0] if fp is not None else None
        if unsharded is not None:
            out.append(unsharded)
        if p.grad is not None and _local(p.grad).numel():
            out.append(_local(p.grad))
    out.extend(t for g in _param_groups(modules) if (t := getattr(g, "_partial_reduce_output", None)) is not None)
    return out


def load(modules, optimizer, state) -> None:
    """Put back what :func:`save` returned (ValueError if it does not fit this model and optimizer)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("the saved open window was not written by the FSDP2 back end (a per-parameter gradient "
                         "list from another back end?): resume it with the back end that saved it")
    params = _optimizer_params(optimizer)
    saved = state["params"]
    if len(saved) != len(params):
        raise ValueError(f"the saved window holds {len(saved)} gradients, the optimizer has {len(params)} parameters")
    groups = _param_groups(modules)
    if len(state["partial"]) != len(groups):
        raise ValueError(f"the saved window holds {len(state['partial'])} FSDP2 parameter groups, the model has "
                         f"{len(groups)}")
    by_id = _fsdp_params(modules)
    if any(entry["unsharded"] is not None for entry in saved):
        for module in modules:  # creates each FSDPParam's unsharded parameter (collective, same on every rank)
            module.unshard()
        for module in modules:
            module.reshard()
    for p, entry in zip(params, saved):
        fp = by_id.get(id(p))
        if entry["unsharded"] is not None:
            if fp is None:
                raise ValueError("the saved window holds an unsharded gradient for a parameter FSDP2 does not manage")
            unsharded = fp._unsharded_param
            g = entry["unsharded"]
            if tuple(g.shape) != tuple(unsharded.shape):
                raise ValueError(f"a saved unsharded gradient has shape {tuple(g.shape)}, the parameter "
                                 f"{tuple(unsharded.shape)}")
            if entry["accumulated"]:
                fp.unsharded_accumulated_grad = g.to(device=unsharded.device, dtype=fp.reduce_dtype, copy=True)
            else:
                unsharded.grad = g.to(device=unsharded.device, dtype=unsharded.dtype, copy=True)
        if entry["sharded"] is not None:
            grad = torch.zeros_like(p)
            local = _local(grad)
            if tuple(local.shape) != tuple(entry["sharded"].shape):
                raise ValueError(f"a saved gradient shard has shape {tuple(entry['sharded'].shape)}, this rank's "
                                 f"shard {tuple(local.shape)}: resume with the world size that saved it")
            local.copy_(entry["sharded"])
            p.grad = grad
        else:
            p.grad = None
    for group, t in zip(groups, state["partial"]):
        if t is not None:
            group._partial_reduce_output = t.to(device=group.device, copy=True)


__all__ = ["FORMAT", "load", "save", "tensors"]
