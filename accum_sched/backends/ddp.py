"""DistributedDataParallel: non-boundary micro-batches run under ``no_sync()``; the boundary one is reduced by the
engine's comm hook (:mod:`.ddp_hook`), which also carries the window's numbers and takes the gradient norm, or, for a
model built with :func:`~accum_sched.backends.ddp_carrier.wrap_ddp`, by DDP's own reduction with the numbers in a
parameter of their own."""
from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

from accum_sched import collective
from accum_sched.backends import ddp_hook
from accum_sched.backends.ddp_carrier import carrier_of
from accum_sched.backends.ddp_hook import HookState, HookTakenOver
from accum_sched.backends.detect import refuse_fsdp_submodules
from accum_sched.backends.torch_optim import TorchBackend
from accum_sched.step_rules import NO_CONTEXT


class DDPBackend(TorchBackend):
    """DistributedDataParallel: forward and backward of non-boundary micro-batches run under ``no_sync()``.

    A model built with :func:`~accum_sched.backends.ddp_carrier.wrap_ddp` carries the window's numbers in a
    parameter of its own, reduced by DDP's C++ reducer with the gradients: no comm hook, no collective of their own
    (the rounds and bytes are then counted from the synchronised backwards: DDP reduces every bucket once in each).
    Otherwise, with the engine's comm hook (:mod:`.ddp_hook`) the window's numbers and the gradient norm come out of
    DDP's own gradient all-reduce: no collective of their own. Where the hook cannot be used (the user registered a
    hook, ``count_allreduce=False``, or low-precision buckets that cannot hold the counts exactly) the numbers take one
    small all-reduce, started before the last backward so that it overlaps it.
    """

    name = "DDP"
    capabilities = dataclasses.replace(TorchBackend.capabilities, noise_scale="buckets")
    averages_over_world = True

    def __init__(self, model: DistributedDataParallel, optimizer, lr_scheduler=None, *, precision: str = "fp32",
                 count_allreduce: bool = True):
        refuse_fsdp_submodules(model)
        super().__init__(model, optimizer, lr_scheduler, precision=precision)
        if getattr(model, "static_graph", False):
            raise ValueError("DistributedDataParallel(static_graph=True) is not supported: static_graph records the "
                             "first iterations' reduction order and breaks under no_sync() accumulation; "
                             "construct DDP without static_graph (find_unused_parameters=True works)")
        self.world_size = collective.world_size()
        self.hook: HookState | None = None
        self._stats_work = None
        self._base = (0, 0)  # the hook's (rounds, bytes) when this back end took it (a later engine on the model)
        self._carrier = carrier_of(model)  # wrap_ddp: the numbers ride in DDP's own reduction, no hook
        if self._carrier is not None and getattr(model, "find_unused_parameters", False):
            raise ValueError("a wrap_ddp model needs find_unused_parameters=False (DDP would mark the window's carrier "
                             "parameter unused in the forward and refuse its gradient in the backward)")
        self._pending = None  # carrier: this window's numbers, added to the loss of its last backward
        self._rounds = 0  # carrier: synchronised backwards (one round of every bucket each)
        self._round_bytes = 0 if self._carrier is None else sum(  # carrier: what one round reduces
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        # the hook of an earlier engine on this model stays registered (DDP cannot remove it) and sums without
        # dividing: this engine must drive it even with count_allreduce=False, or its gradients would be world x
        if self._carrier is None and (count_allreduce or ddp_hook.installed(model)):
            try:
                # DDP takes one comm hook per module for good: an engine built on a model that an earlier engine
                # drove takes that engine's hook over (ddp_hook.install); the earlier engine refuses further use
                self.hook = ddp_hook.install(model, self)
                self._base = (self.hook.rounds, self.hook.bytes)
            except RuntimeError as exc:  # the user registered a hook of their own: keep it, count nothing
                warnings.warn(f"gradient all-reduce rounds are not counted and the window's numbers take one small "
                              f"all-reduce per step of their own: a comm hook that is not the engine's is "
                              f"registered on this DistributedDataParallel module ({exc})", stacklevel=3)
        # our hook sums (see .ddp_hook); DDP's own reduction, or a user's hook, takes the mean
        self.averages_over_world = self.hook is None
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        # counts ride in a bucket only where its dtype holds them exactly (window_stats: fp32 or wider)
        self._stats_in_bucket = (self._carrier is None and self.hook is not None
                                 and dtypes <= {torch.float32, torch.float64})
        in_gradients = self._stats_in_bucket or self._carrier is not None  # in the gradient collective (fp32)
        self._stats_group = None if in_gradients else collective.stats_group()
        self.stats_dtype = torch.float32 if in_gradients else torch.float64
        self.capabilities = dataclasses.replace(self.capabilities, stats_in_gradient_collective=in_gradients)
        # The hook's bucket norms cover every DDP parameter; use them only when those are the optimizer's.
        ddp_elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt_elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        self._norm_in_hook = self.hook is not None and self.scaler is None and ddp_elements == opt_elements

    def _own_hook(self) -> None:
        if self.hook is not None and self.hook.owner is not self:
            raise HookTakenOver("this AccumulationEngine's DDP comm hook was taken over by a later AccumulationEngine "
                                "built on the same DistributedDataParallel model (DDP takes one hook per model); "
                                "train with the later engine only")

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        self._own_hook()
        if self.hook is not None:
            self.hook.want_norm = want_norm and self._norm_in_hook
            self.hook.squared_norms = []
        if self._carrier is not None:
            self._pending = stats
        elif self._stats_in_bucket:
            self.hook.reduced_stats = None
            self.hook.pending_stats = stats
        else:
            self._stats = stats
            self._stats_work = collective.all_sum_async(stats, group=self._stats_group)

    def backward(self, loss: torch.Tensor) -> None:
        # TorchBackend.backward's two steps, with the carrier's term between them (no super() call: this runs for
        # every micro-batch on every DDP model)
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        if self._pending is not None:  # wrap_ddp, the window's last backward
            # d(loss + sum(window * numbers)) / d window = numbers, exactly; the loss's own gradient is unchanged
            # (mul and sum, not dot: no autocast list lowers them, so the numbers stay fp32)
            pending, self._pending = self._pending, None
            loss = loss + (self._carrier * pending).sum()
            self._rounds += 1
        loss.backward()

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._carrier is not None:
            reduced, self._carrier.grad = self._carrier.grad, None  # the next window's backward must not add to it
            stats = reduced * self.world_size  # DDP's own reduction took the mean over ranks
        elif self._stats_in_bucket:
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
        self._own_hook()
        self.hook.before_reduce.append(before)
        self.hook.after_reduce.append(after)
        return True

    @property
    def allreduce_rounds(self):
        if self._carrier is not None:
            return self._rounds
        return None if self.hook is None else self.hook.rounds - self._base[0]

    @property
    def allreduce_bytes(self):
        if self._carrier is not None:
            return self._rounds * self._round_bytes
        return None if self.hook is None else self.hook.bytes - self._base[1]

    def sync_context(self, boundary: bool):
        self._own_hook()  # before the micro-batch's forward: a taken-over engine touches no gradient
        return NO_CONTEXT if boundary else self.model.no_sync()


__all__ = ["DDPBackend"]
