"""An open window under DeepSpeed (ZeRO 0-3, fp32 or bf16 weights): this rank's accumulated gradient, saved and put
back.

Where DeepSpeed 0.19 keeps a window's gradient between micro-batches (measured with the managed boundary this back end
sets before every micro-batch, see :mod:`accum_sched.backends.deepspeed`):

* ZeRO 0 (the client torch optimizer; with bf16 weights ``FP16_UnfusedOptimizer``) and ZeRO 1
  (``DeepSpeedZeroOptimizer``, gradients not partitioned): the parameters' ``.grad``, this rank's local, not yet
  reduced, sum (bf16 with bf16 weights); the boundary reduces it.
* ZeRO 1 with bf16 weights and ``data_types.grad_accum_dtype: fp32`` (``BF16_Optimizer``): each backward's epilogue
  adds the bf16 ``.grad`` (zeroed again before the next backward) into the flat fp32 ``fp32_groups_gradients_flat``
  and marks the parameter in ``fp32_groups_has_gradients``; the boundary all-reduces that buffer.
* ZeRO 2 (``DeepSpeedZeroOptimizer``, partitioned gradients): every backward reduces, and the epilogue adds the
  reduced gradients of the parameters in this rank's partition into ``all_grad_tensors[group]`` (one tensor per
  parameter in the partition, in the accumulation dtype); the boundary flattens that sum into ``averaged_gradients``.
  With bf16 weights and fp32 accumulation the reduction adds straight into one compact fp32 buffer per group,
  ``averaged_gradients[group].flat_partition``, built at the window's first reduction and read by the step as it is.
* ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``): every backward reduce-scatters into this rank's gradient partitions,
  views of one flat ``grad_partitions_flat_buffer`` (in the accumulation dtype); ``micro_step_id`` (0: copy, else
  add) and the flag that advances it at the next forward say whether the next backward accumulates.

These are this rank's own tensors (per rank, same world size only), saved as CPU copies in the engine's window state
(the launcher's ``window-rank<R>.pt``) and put back in place on resume, after DeepSpeed's own checkpoint is loaded;
the next micro-batches add into them as they would have. Not covered (the back end keeps stopping at the boundary):
fp16 weights (DeepSpeed's loss scaler, CUDA only, never run here), ``BF16_Optimizer`` with
``immediate_grad_update`` (its hooks accumulate during the backward), ZeRO optimizer offload.
"""
from __future__ import annotations

import torch

FORMAT = "deepspeed-window-1"


def supported(ds_engine) -> str | None:
    """None where an open window can be saved and restored exactly, else why not (one phrase)."""
    if ds_engine.fp16_enabled():
        return "with fp16 weights (DeepSpeed's loss scaler, CUDA only) an open window is not saved"
    if ds_engine.bfloat16_enabled():
        get_types = getattr(ds_engine, "get_data_types", None)
        types = tuple(get_types()) if callable(get_types) else None
        if types not in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
            return f"bf16 weights with gradient accumulation dtypes {types}"
    if ds_engine.zero_optimization() and ds_engine.zero_use_cpu_optimizer():
        return "ZeRO optimizer offload accumulates in CPU buffers"
    stage = int(ds_engine.zero_optimization_stage())
    if stage not in (0, 1, 2, 3):
        return f"ZeRO stage {stage}"
    opt = ds_engine.optimizer
    if _bf16_optimizer(opt):  # ZeRO 1, bf16 weights, fp32 accumulation
        if getattr(opt, "immediate_grad_update", None) is not False:
            return "BF16_Optimizer with immediate_grad_update"
        if not (isinstance(getattr(opt, "fp32_groups_gradients_flat", None), list)
                and isinstance(getattr(opt, "fp32_groups_has_gradients", None), list)):
            return "this DeepSpeed's BF16_Optimizer buffers are not the ones 0.19 has"
        return None
    if stage in (1, 2) and getattr(opt, "use_grad_accum_attribute", False):
        return "gradients accumulate in a separate dtype (grad_accum)"
    if stage in (1, 2):
        compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
        if compact is None or not isinstance(getattr(opt, "all_grad_tensors", None), dict):
            return "this DeepSpeed's ZeRO 1/2 accumulation buffers are not the ones 0.19 has"
        if stage == 1 and any(compact(i) for i in range(len(opt.bit16_groups))):
            return "ZeRO 1 accumulates in compact partition buffers"
        if stage == 2 and any(compact(i) for i in range(len(opt.bit16_groups))) and not callable(
                getattr(opt, "_get_compact_grad_partition_buffer", None)):
            return "this DeepSpeed's compact gradient partition buffers are not the ones 0.19 has"
    if stage == 3 and not isinstance(getattr(opt, "grad_partitions_flat_buffer", None), torch.Tensor):
        return "ZeRO 3 has no flat gradient partition buffer"
    return None


def _bf16_optimizer(opt) -> bool:
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(opt, BF16_Optimizer)


def _compact(opt, i: int) -> bool:
    """ZeRO 2 with bf16 weights and fp32 accumulation: group ``i`` accumulates in one flat fp32 partition buffer."""
    return bool(opt._use_compact_grad_partition_buffer(i))


def _stage(ds_engine) -> int:
    return int(ds_engine.zero_optimization_stage()) if ds_engine.zero_optimization() else 0


def _cpu(t):
    return None if t is None else t.detach().to("cpu", copy=True)


def _grad_params(ds_engine) -> list:
    """ZeRO 0/1: the parameters whose ``.grad`` holds the window (the module's, in order)."""
    return list(ds_engine.module.parameters())


def save(ds_engine) -> dict:
    """This rank's open window (see the module docstring), as CPU tensors."""
    stage, opt = _stage(ds_engine), ds_engine.optimizer
    state = {"format": FORMAT, "stage": stage}
    if _bf16_optimizer(opt):
        state.update(hp_flat=[_cpu(t) for t in opt.fp32_groups_gradients_flat],
                     has_grads=[[bool(b) for b in g] for g in opt.fp32_groups_has_gradients])
    elif stage in (0, 1):
        state["grads"] = [_cpu(p.grad) for p in _grad_params(ds_engine)]
    elif stage == 2:
        state["groups"] = [_save_group(opt, i) for i in range(len(opt.bit16_groups))]
    else:
        state.update(flat=_cpu(opt.grad_partitions_flat_buffer), micro_step_id=int(opt.micro_step_id),
                     epilogue_ran=bool(getattr(opt, "_epilogue_ran_this_backward", False)))
    return state


def _save_group(opt, i: int):
    """ZeRO 2, group ``i``: None (nothing accumulated yet), its per-parameter sums, or ``{"compact": flat}``."""
    if _compact(opt, i):
        group = opt.averaged_gradients.get(i)
        return None if group is None else {"compact": _cpu(group.flat_partition)}
    return None if opt.all_grad_tensors.get(i) is None else [_cpu(t) for t in opt.all_grad_tensors[i]]


def _group_tensors(opt, i: int) -> list[torch.Tensor]:
    if _compact(opt, i):
        group = opt.averaged_gradients.get(i)
        return [] if group is None else [group.flat_partition]
    return list(opt.all_grad_tensors.get(i) or ())


def tensors(ds_engine) -> list[torch.Tensor]:
    """The open window's gradients in place (scaling them scales the window's gradient)."""
    stage, opt = _stage(ds_engine), ds_engine.optimizer
    if _bf16_optimizer(opt):
        return list(opt.fp32_groups_gradients_flat)
    if stage in (0, 1):
        return [p.grad for p in _grad_params(ds_engine) if p.grad is not None]
    if stage == 2:
        return [t for i in range(len(opt.bit16_groups)) for t in _group_tensors(opt, i)]
    return [opt.grad_partitions_flat_buffer]


def _fit(saved: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
    if tuple(saved.shape) != tuple(like.shape):
        raise ValueError(f"the saved window's {what} has shape {tuple(saved.shape)}, this run's {tuple(like.shape)}: "
                         f"resume with the world size and model that saved it")
    return saved.to(device=like.device, dtype=like.dtype, copy=True)


def load(ds_engine, state) -> None:
    """Put back what :func:`save` returned (ValueError if it does not fit this engine)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("the saved open window was not written by the DeepSpeed back end: resume it with the back "
                         "end that saved it")
    stage, opt = _stage(ds_engine), ds_engine.optimizer
    if state["stage"] != stage:
        raise ValueError(f"the saved open window is of ZeRO stage {state['stage']}, this engine runs stage {stage}")
    if _bf16_optimizer(opt) != ("hp_flat" in state):
        raise ValueError("the saved open window was written with another gradient accumulation dtype (bf16 weights: "
                         "BF16_Optimizer's fp32 buffer or not): resume with the DeepSpeed configuration that saved it")
    if _bf16_optimizer(opt):
        flats, has_grads = state["hp_flat"], state["has_grads"]
        if len(flats) != len(opt.fp32_groups_gradients_flat) or len(has_grads) != len(flats):
            raise ValueError(f"the saved window holds {len(flats)} parameter groups, the optimizer "
                             f"{len(opt.fp32_groups_gradients_flat)}")
        for i, (flat, saved) in enumerate(zip(opt.fp32_groups_gradients_flat, flats)):
            flat.copy_(_fit(saved, flat, "fp32 gradient buffer"))  # in place: the per-parameter views stay
            if len(has_grads[i]) != len(opt.fp32_groups_has_gradients[i]):
                raise ValueError(f"the saved window's group {i} has {len(has_grads[i])} parameters, the optimizer's "
                                 f"{len(opt.fp32_groups_has_gradients[i])}")
            opt.fp32_groups_has_gradients[i] = [bool(b) for b in has_grads[i]]
    elif stage in (0, 1):
        params = _grad_params(ds_engine)
        if len(state["grads"]) != len(params):
            raise ValueError(f"the saved window holds {len(state['grads'])} gradients, the model has {len(params)} "
                             f"parameters")
        for p, g in zip(params, state["grads"]):
            p.grad = None if g is None else _fit(g, p, "gradient")
    elif stage == 2:
        groups = state["groups"]
        if len(groups) != len(opt.bit16_groups):
            raise ValueError(f"the saved window holds {len(groups)} parameter groups, the optimizer "
                             f"{len(opt.bit16_groups)}")
        for i, saved in enumerate(groups):
            if isinstance(saved, dict) != _compact(opt, i):
                raise ValueError("the saved open window was written with another gradient accumulation dtype: "
                                 "resume with the DeepSpeed configuration that saved it")
            if _compact(opt, i):
                if saved is None:
                    opt.averaged_gradients[i] = None
                else:
                    flat = opt._get_compact_grad_partition_buffer(i).flat_partition
                    flat.copy_(_fit(saved["compact"], flat, "compact gradient partition"))
                continue
            if saved is None:
                opt.all_grad_tensors[i] = None
                continue
            params = opt.params_in_partition[i]
            if len(saved) != len(params):
                raise ValueError(f"the saved window holds {len(saved)} gradients of group {i}, this rank's partition "
                                 f"{len(params)}: resume with the world size that saved it")
            opt.all_grad_tensors[i] = [_fit(g, p, "partition gradient").to(opt.gradient_accumulation_dtype)
                                       for g, p in zip(saved, params)]
    else:
        flat = opt.grad_partitions_flat_buffer
        flat.copy_(_fit(state["flat"], flat, "gradient partition"))
        opt.micro_step_id = int(state["micro_step_id"])
        opt._epilogue_ran_this_backward = bool(state["epilogue_ran"])


__all__ = ["FORMAT", "load", "save", "supported", "tensors"]
