"""How gradients meet: one small interface, one class per back end.

The engine decides *when* a window ends and *by how much* its gradient must be scaled; a back end knows *how* to
keep non-boundary micro-batches local, how to backward, how the window's numbers are summed over ranks, and how to
scale, clip and step. Torch back ends (single process and DDP) share :class:`TorchBackend`; the DeepSpeed back end
lives in :mod:`accum_sched.deepspeed_backend` and is imported only when a DeepSpeed engine is handed in. The rules
they share (clipping, LR coupling, the fused norm) are in :mod:`accum_sched.step_rules`.

Per window the engine calls ``send_window_stats(stats, want_norm)`` just before the boundary backward and
``window_totals(want_norm)`` after it; the latter returns device tensors (summed stats, squared gradient norm or
None) and never waits for the device, so the engine reads everything with one host transfer per optimizer step.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from accum_sched import collective
from accum_sched.ddp_hook import HookState, engine_hook
from accum_sched.step_rules import NO_CONTEXT, gradient_scale, scale_gradients, scaled_lr, squared_norm


class TorchBackend:
    """Gradients live in ``param.grad`` and a torch optimizer steps them (single process)."""

    #: True when the gradient collective averages over ranks (DDP), so the engine multiplies by world size.
    averages_over_world = False
    #: The engine may multiply losses by a per-window constant (see AccumulationEngine._window_prescale).
    prescale_ok = True
    #: local_grads/load_local_grads work, so a stop may leave a window open (engine stop_at="micro_batch").
    partial_window_ok = True

    def __init__(self, model: torch.nn.Module, optimizer, lr_scheduler=None, scaler=None):
        if optimizer is None:
            raise ValueError("optimizer is required for a torch model (only a DeepSpeed engine brings its own)")
        self.model, self.optimizer, self.lr_scheduler, self.scaler = model, optimizer, lr_scheduler, scaler
        self.world_size = 1

    @property
    def allreduce_rounds(self) -> int | None:
        """Gradient all-reduce rounds launched so far (None where they cannot be counted)."""
        return 0

    @property
    def allreduce_bytes(self) -> int | None:
        return 0

    # -- per micro-batch ----------------------------------------------------------------------------------------
    def sync_context(self, boundary: bool):
        """Entered around forward AND backward of a micro-batch; only the boundary one may communicate."""
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    # -- per window ---------------------------------------------------------------------------------------------
    #: dtype the window's numbers are summed in (see accum_sched.window_stats)
    stats_dtype = torch.float64

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        """Called just before the window's last backward with this rank's numbers (one process: nothing to sum)."""
        self._stats = stats

    def _squared_norm(self) -> torch.Tensor:
        """Squared global L2 norm of the (synchronised, unscaled) accumulated gradient, before normalisation."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return squared_norm(self._grads())

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last backward: (the window's numbers summed over ranks, squared gradient norm if wanted)."""
        stats, self._stats = self._stats, None
        return stats, self._squared_norm() if want_norm else None

    def step(self, coef: float, max_norm: float | None, norm: float | None, skip: bool, lr_scale: float = 1.0) -> None:
        """Scale the window's gradient by ``coef`` (and clip to ``max_norm``), step, advance the LR, clear.

        ``lr_scale`` multiplies the learning rate for this step only (LR coupling to the effective batch); it is
        undone before the LR scheduler steps, so schedulers never see it.
        """
        if not skip:
            scale = gradient_scale(coef, max_norm, norm)
            if scale != 1.0:  # full windows with a known micro-batch size are exact already (engine prescale)
                scale_gradients(self._grads(), scale)
            with scaled_lr(self.optimizer, lr_scale):
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                else:
                    self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        # A step the GradScaler skipped (fp16 overflow) took no optimizer step: the LR schedule waits (as HF Trainer).
        if self.lr_scheduler is not None and not (skip and self.scaler is not None):
            with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- an open window (stopped inside it) ---------------------------------------------------------------------
    def local_grads(self) -> list:
        """This rank's accumulated gradient of an open window, one CPU tensor (or None) per optimizer parameter.
        Under DDP's no_sync these are the local, not yet reduced, gradients: they differ per rank."""
        return [None if p.grad is None else p.grad.detach().cpu().clone()
                for group in self.optimizer.param_groups for p in group["params"]]

    def local_grad_tensors(self) -> list[torch.Tensor]:
        """The open window's local gradients in place (to rescale them after a resume)."""
        return self._grads()

    def load_local_grads(self, grads: list) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(grads) != len(params):
            raise ValueError(f"the saved window holds {len(grads)} gradients, the optimizer has {len(params)} "
                             f"parameters")
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Counter:
    """State of a counting-only DDP comm hook (benchmarks and tests count hand-written loops with it)."""

    def __init__(self):
        self.rounds = 0
        self.bytes = 0
        # optional callbacks around each bucket's all-reduce (accum_sched.noise_scale): before(bucket) sees this
        # rank's own gradient, after(bucket, reduced) the all-reduced one
        self.before_reduce = None
        self.after_reduce = None


def _counting_allreduce(state: _Counter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    if state.before_reduce is not None:
        state.before_reduce(bucket)
    if bucket.is_last():  # one backward = one round, however many buckets it takes
        state.rounds += 1
    future = default_hooks.allreduce_hook(None, bucket)
    if state.after_reduce is not None:
        after = state.after_reduce

        def observe(fut):
            reduced = fut.value()
            after(bucket, reduced)
            return reduced

        future = future.then(observe)
    return future


class DDPBackend(TorchBackend):
    """DistributedDataParallel: forward and backward of non-boundary micro-batches run under ``no_sync()``.

    With the engine's comm hook (:mod:`accum_sched.ddp_hook`) the window's numbers and the gradient norm come out of
    DDP's own gradient all-reduce: no collective of their own. Where the hook cannot be used (the user registered a
    hook, ``count_allreduce=False``, or low-precision buckets that cannot hold the counts exactly) the numbers take one
    small all-reduce, started before the last backward so that it overlaps it.
    """

    averages_over_world = True

    def __init__(self, model: DistributedDataParallel, optimizer, lr_scheduler=None, scaler=None,
                 count_allreduce: bool = True):
        super().__init__(model, optimizer, lr_scheduler, scaler)
        if getattr(model, "static_graph", False):
            raise ValueError("DistributedDataParallel(static_graph=True) is not supported: static_graph records the "
                             "first iterations' reduction order and breaks under no_sync() accumulation; "
                             "construct DDP without static_graph (find_unused_parameters=True works)")
        self.world_size = collective.world_size()
        self.hook: HookState | None = None
        self._stats_work = None
        if count_allreduce:
            state = HookState(model.process_group)
            try:
                model.register_comm_hook(state, engine_hook)
                self.hook = state
            except RuntimeError as exc:  # the user registered a hook of their own: keep it, count nothing
                warnings.warn(f"gradient all-reduce rounds are not counted: {exc}", stacklevel=3)
        # our hook sums (see accum_sched.ddp_hook); DDP's own reduction, or a user's hook, takes the mean
        self.averages_over_world = self.hook is None
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        # counts ride in a bucket only where its dtype holds them exactly (window_stats: fp32 or wider)
        self._stats_in_bucket = self.hook is not None and dtypes <= {torch.float32, torch.float64}
        self._stats_group = None if self._stats_in_bucket else collective.stats_group()
        self.stats_dtype = torch.float32 if self._stats_in_bucket else torch.float64
        # The hook's bucket norms cover every DDP parameter; use them only when those are the optimizer's.
        ddp_elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt_elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        self._norm_in_hook = self.hook is not None and scaler is None and ddp_elements == opt_elements

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        if self.hook is not None:
            self.hook.want_norm = want_norm and self._norm_in_hook
            self.hook.squared_norms = []
        if self._stats_in_bucket:
            self.hook.reduced_stats = None
            self.hook.pending_stats = stats
        else:
            self._stats = stats
            self._stats_work = collective.all_sum_async(stats, group=self._stats_group)

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._stats_in_bucket:
            stats, self.hook.reduced_stats = self.hook.reduced_stats, None
            if stats is None:  # the boundary backward reduced nothing (no parameter took part): sum them here
                stats, self.hook.pending_stats = collective.all_sum(self.hook.pending_stats.double()), None
        else:
            if self._stats_work is not None:
                self._stats_work.wait()
            stats, self._stats, self._stats_work = self._stats, None, None
        if not want_norm:
            return stats, None
        squared = self.hook.take_norm() if self._norm_in_hook else None
        return stats, squared if squared is not None else self._squared_norm()

    def observe_buckets(self, before, after) -> bool:
        """Call ``before(bucket)`` ahead of every bucket's all-reduce and ``after(bucket, reduced)`` once it is
        reduced (comm hook thread); False when our comm hook is not installed."""
        if self.hook is None:
            return False
        self.hook.before_reduce.append(before)
        self.hook.after_reduce.append(after)
        return True

    @property
    def allreduce_rounds(self):
        return None if self.hook is None else self.hook.rounds

    @property
    def allreduce_bytes(self):
        return None if self.hook is None else self.hook.bytes

    def sync_context(self, boundary: bool):
        return NO_CONTEXT if boundary else self.model.no_sync()


def is_deepspeed_engine(model) -> bool:
    """True for a DeepSpeedEngine (recognised without importing DeepSpeed)."""
    return type(model).__name__ == "DeepSpeedEngine" or hasattr(model, "set_gradient_accumulation_boundary")


def make_backend(model, optimizer=None, lr_scheduler=None, scaler=None, count_allreduce: bool = True,
                 gradient_sync: str = "boundary"):
    """Pick the back end for ``model``: a DeepSpeed engine, an FSDP2 root, a DDP module, or a plain module in one
    process. ``gradient_sync`` (FSDP2 only): ``"boundary"`` or ``"every_micro_batch"``."""
    if is_deepspeed_engine(model):
        from accum_sched.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(model, optimizer=optimizer, lr_scheduler=lr_scheduler)
    fsdp = _fsdp_module_class()
    if fsdp is not None and isinstance(model, fsdp):
        from accum_sched.fsdp_backend import FSDPBackend

        return FSDPBackend(model, optimizer, lr_scheduler, scaler, gradient_sync=gradient_sync)
    if gradient_sync != "boundary":
        raise ValueError(f"gradient_sync={gradient_sync!r} applies to FSDP2 models only (fully_shard)")
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        raise ValueError("fully_shard was applied to submodules but not to the model handed to the engine; apply "
                         "it to the root too (fully_shard(model)) after its blocks")
    if isinstance(model, DistributedDataParallel):
        return DDPBackend(model, optimizer, lr_scheduler, scaler, count_allreduce)
    if collective.world_size() > 1:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the model is not wrapped in "
                         f"DistributedDataParallel, so gradients would never meet; wrap it: "
                         f"DistributedDataParallel(model)")
    return TorchBackend(model, optimizer, lr_scheduler, scaler)


def _fsdp_module_class():
    """torch's FSDPModule if FSDP2 is in use (its module imported); never imports it for DDP or one process."""
    import sys

    module = sys.modules.get("torch.distributed.fsdp")
    return None if module is None else getattr(module, "FSDPModule", None)
