"""DeepSpeed back end: our engine owns the accumulation boundary, DeepSpeed does the rest.

How a window runs (DeepSpeed's managed mode, boundary set by us):

* every micro-batch: ``set_gradient_accumulation_boundary(last_of_window)`` before its forward, then
  ``backward(loss_sum, scale_wrt_gas=False)`` (DeepSpeed does not divide by its GAS: our engine normalises), then
  ``step()`` on non-boundary micro-batches only, which merely advances DeepSpeed's micro-step counter. DeepSpeed's own
  ``(micro_steps + 1) % gas`` rule is never consulted, so a factor that changes mid-run, or a partial window at an
  epoch end, puts boundaries exactly where the engine says (relying on ``set_train_batch_size`` alone does not: the
  global micro-step counter is rarely a multiple of the new factor).
* at the boundary the reduced gradient sits in the storage DeepSpeed's optimizer will consume at ``step()``: the
  parameters' ``.grad`` (no ZeRO), the fp32 accumulation buffer (BF16_Optimizer), or this rank's partition
  (``averaged_gradients`` of ZeRO 1/2/3). When the norm is wanted (clipping, logging, non-finite check) we take it
  over that storage in one fused pass, multiply the storage in place by the engine's coefficient (times torch's
  clipping factor), and call ``step()``, which runs DeepSpeed's optimizer, LR scheduler and counters. Scaling a
  partition is exact: the full gradient is the concatenation of the partitions, so scaling each one scales the whole.
* the window's numbers (counts, loss, flags): without ZeRO, in fp32, they ride at the end of the first gradient
  bucket DeepSpeed flattens and all-reduces at the boundary (its ``allreduce_bucket``, wrapped on this engine
  instance; the flattening copies every gradient anyway, so they cost no collective and no pass of their own). At
  ZeRO 1-3 (whose reductions are partitioned and stage-specific) and in bf16 they take one small all-reduce per
  step: started before the last backward so that it overlaps it, or, when a partitioned norm must be summed too
  (ZeRO 1-3 with the norm wanted), after the backward, together with the partition's squared norm in the same
  all-reduce. Either way at most one small collective per optimizer step, never two.
* a skipped step (non-finite gradient, empty window) runs ``step()`` with the inner torch optimizer's ``step``
  replaced by a no-op: DeepSpeed clears its buffers and advances its counters, the weights do not move.

DeepSpeed's ``train_batch_size`` / ``gradient_accumulation_steps`` follow the engine's factor
(``set_train_batch_size(micro x factor x world)``), and ``global_samples`` is advanced by the real number of samples of
each window (partial windows included), so DeepSpeed's logs, LR scheduler and checkpoints see true numbers.

DeepSpeed is imported inside the functions that need it, and the registry (:mod:`accum_sched.backends.registry`)
imports this module only when a DeepSpeed engine is handed in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings

import torch

from accum_sched import collective
from accum_sched.backends import deepspeed_window
from accum_sched.backends.base import Backend, Capabilities, check_precision
from accum_sched.step_rules import NO_CONTEXT, gradient_scale, scale_gradients, scaled_lr, squared_norm


def ensure_torch_extensions_dir() -> str:
    """Point ``TORCH_EXTENSIONS_DIR`` at a stable cache unless it is set; returns the directory in use.

    Call it before ``deepspeed.initialize``. DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op
    (``deepspeed_shm_comm``) whenever its comm layer starts, whether or not training uses it: about 60 s the first
    time, a cache hit afterwards. A fixed place (``$XDG_CACHE_HOME/accum-sched/torch_extensions``, else
    ``~/.cache/...``) is one CI can cache between runs.
    """
    path = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not path:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(cache, "accum-sched", "torch_extensions")
        os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


def import_deepspeed():
    """``import deepspeed``, about 1.6 s faster per process where mlflow is installed (measured on the 2-core
    development machine: 2.07 s -> 0.41 s after torch).

    DeepSpeed's autotuner (``deepspeed.autotuning.autotuner``, imported by ``deepspeed/__init__``) tries ``import
    mlflow`` at import time, for autotuning runs only, which this package never starts; importing mlflow pulls in
    pandas and the rest of its client. While DeepSpeed is first imported, mlflow is made to look absent (a None entry
    in ``sys.modules``, which makes that import fail), and only if nothing had imported it yet; the entry is taken out
    again afterwards, so a later ``import mlflow`` (a tracker, the user's own code) imports it as usual.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def _optimizer_classes():
    """DeepSpeed's optimizer wrappers, by the storage their gradient lives in (imported lazily: DeepSpeed is heavy)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # the last one is a tuple: both low-precision wrappers without ZeRO keep the gradient in the params' .grad
    return DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer, (FP16_Optimizer,
                                                                                    FP16_UnfusedOptimizer)


class DeepSpeedBackend(Backend):
    """Drives a ``DeepSpeedEngine`` (ZeRO 0-3, fp32 or bf16) under the accumulation engine.

    Args:
        ds_engine: what ``deepspeed.initialize`` returned first.
        optimizer: None, or the optimizer DeepSpeed wraps (the client optimizer given to ``deepspeed.initialize`` or
            ``ds_engine.optimizer``); DeepSpeed always steps it.
        lr_scheduler: None, or a scheduler DeepSpeed does not know about (we step it once per optimizer step). A
            scheduler given to ``deepspeed.initialize`` (or from the JSON's ``scheduler`` section) is stepped by
            DeepSpeed itself.
        precision: what the engine's autocast runs the forward in; DeepSpeed's JSON decides the weights' precision
            (its own loss scaler under fp16; the launcher checks that both say the same).
    """

    name = "DeepSpeed"
    # A stop inside a window: per instance, where accum_sched.backends.deepspeed_window can save and restore the
    # window's accumulated gradient exactly (ZeRO 0-3, fp32 or bf16 weights); elsewhere the engine stops at the
    # boundary. The noise scale reads .grad after the window's last backward (ZeRO-0 in fp32, noise_params).
    capabilities = Capabilities(stop_mid_window=False, prescale=True, fp16="native", noise_scale="accumulated_grad")

    def __init__(self, ds_engine, optimizer=None, lr_scheduler=None, *, precision: str = "fp32"):
        self.precision = check_precision(precision)
        self.ds = ds_engine
        opt = getattr(ds_engine, "optimizer", None)
        if opt is None or type(opt).__name__ == "DummyOptim":
            raise ValueError("the DeepSpeed engine has no optimizer: pass optimizer= to deepspeed.initialize or give "
                             "the JSON an \"optimizer\" section")
        if optimizer is not None and optimizer is not opt and optimizer is not getattr(ds_engine, "basic_optimizer",
                                                                                        None):
            raise ValueError("optimizer= is not the optimizer this DeepSpeed engine wraps; pass None (DeepSpeed steps "
                             "its own optimizer) or the one given to deepspeed.initialize")
        if not ds_engine.managed_gradient_accumulation():
            raise ValueError("\"managed_gradient_accumulation\": false is not supported: the accumulation engine sets "
                             "the boundary itself with set_gradient_accumulation_boundary(); remove that key")
        if getattr(ds_engine, "pipeline_parallelism", False):
            raise ValueError("DeepSpeed pipeline parallelism schedules its own micro-batches; it cannot be driven "
                             "by the accumulation engine")
        if ds_engine.zero_optimization() and ds_engine.zero_use_cpu_optimizer():
            raise ValueError("ZeRO optimizer offload is not supported yet (its gradients bypass the partition buffers "
                             "this back end scales); remove zero_optimization.offload_optimizer")
        if ds_engine.fp16_enabled() and not ds_engine.zero_optimization():
            raise ValueError("fp16 without ZeRO is not supported: DeepSpeed's engine.backward does not multiply the "
                             "loss by the loss scale of its FP16 optimizers, yet their step divides by it (measured "
                             "with 0.19.8); use ZeRO stage 1-3 with fp16, or bf16")
        ds_scheduler = getattr(ds_engine, "lr_scheduler", None)
        if lr_scheduler is not None and ds_scheduler is not None and lr_scheduler is not ds_scheduler:
            raise ValueError("the DeepSpeed engine already has an LR scheduler; pass lr_scheduler=None")
        self.lr_scheduler = lr_scheduler if ds_scheduler is None else None  # the one we step; DeepSpeed steps its own
        self.world_size = int(ds_engine.dp_world_size)
        if self.world_size != collective.world_size():
            raise ValueError(f"DeepSpeed's data-parallel world ({self.world_size}) differs from the process group's "
                             f"({collective.world_size()}): model/pipeline/sequence parallelism is not supported")
        # MEAN (the default) averages the gradient over ranks, so the engine multiplies by the world size.
        self.averages_over_world = bool(getattr(ds_engine, "gradient_average", True))
        # capabilities.prescale: the engine multiplies each loss by the full window's 1/count, so the gradients
        # DeepSpeed stores are normalised already: full windows need no pass over the gradient at the step
        # (measured: that pass cost ~10% of a 1M-parameter ZeRO-0 step at factor 1 on CPU). fp16 needs it all the
        # more: a window sum would be ~N x larger, make the loss scale back off ~N x, and a later 1/N on fp16
        # storage would underflow; there the boundary's remaining correction (a short micro-batch, token counts,
        # clipping) is folded into DeepSpeed's fp32 unscale (_fp32_unscale) instead of a pass over fp16 storage.
        self._fold_into_unscale = bool(ds_engine.fp16_enabled())
        self.at_boundary = True
        self._window_samples: int | None = None
        check_internals(ds_engine)
        self._shapes_checked = False
        self._partitioned = isinstance(opt, _optimizer_classes()[:2])
        self._stats: torch.Tensor | None = None
        self._stats_work = None
        self._stats_group = collective.stats_group()
        self._pending: torch.Tensor | None = None  # the numbers waiting for the boundary's first fp32 bucket
        self._carried: torch.Tensor | None = None  # ... and summed in it (divided as DeepSpeed divides gradients)
        self._carry = self._can_carry()  # the numbers ride in DeepSpeed's gradient all-reduce (decided once)
        if self._carry:
            self.stats_dtype = torch.float32  # the bucket's; base-4096 digits keep the counts exact in it
            self._wrap_allreduce_bucket()
            self.capabilities = dataclasses.replace(self.capabilities, stats_in_gradient_collective=True)
        #: why an open window cannot be saved (None: it can, and a stop may leave the window open)
        self.open_window_refused = deepspeed_window.supported(ds_engine)
        if self.open_window_refused is None:
            self.capabilities = dataclasses.replace(self.capabilities, stop_mid_window=True)

    # counters: DeepSpeed launches its own collectives, so allreduce_rounds/bytes stay the base's None (not counted)

    # -- per micro-batch ----------------------------------------------------------------------------------------
    def sync_context(self, boundary: bool):
        """Tell DeepSpeed, before the forward, whether this micro-batch closes the window."""
        self.at_boundary = boundary
        self.ds.set_gradient_accumulation_boundary(boundary)
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        # scale_wrt_gas=False: DeepSpeed must not divide by its GAS; the engine divides the window's gradient by the
        # global element count at the boundary.
        self.ds.backward(loss, scale_wrt_gas=False)
        if not self.at_boundary:
            self.ds.step()  # not a boundary: only advances DeepSpeed's micro-step counter (no update, no reduction)

    # -- per window ---------------------------------------------------------------------------------------------
    def _grad_storage(self) -> tuple[list[torch.Tensor], bool]:
        """(tensors holding this rank's share of the reduced gradient, whether they are partitioned over ranks)."""
        zero12, zero3, bf16_opt, fp16_opt = _optimizer_classes()
        opt = self.ds.optimizer
        if isinstance(opt, (zero12, zero3)):
            groups = [g for g in opt.averaged_gradients.values() if g is not None]
            return [t for g in groups for t in g if t is not None], True
        if isinstance(opt, bf16_opt):  # ZeRO 1 with bf16 weights: a full fp32 buffer on every rank
            return list(opt.fp32_groups_gradients_flat), False
        if isinstance(opt, fp16_opt):  # no ZeRO, fp16/bf16 weights: the low-precision .grad of every parameter
            return [p.grad for group in opt.fp16_groups for p in group if p.grad is not None], False
        return [p.grad for p in self.ds.module.parameters() if p.grad is not None], False

    def _loss_scale(self) -> float:
        scale = getattr(self.ds.optimizer, "loss_scale", None)
        return 1.0 if scale is None else float(scale)

    def native_loss_scale(self) -> float | None:
        """DeepSpeed's own fp16 loss scale for this window (None without fp16): an inf/NaN gradient under it is an
        overflow, which the engine counts and skips without raising; :meth:`step` then holds the LR schedulers."""
        return self._loss_scale() if self._fold_into_unscale else None

    stats_dtype = torch.float64

    def _can_carry(self) -> bool:
        """Whether the window's numbers can ride in DeepSpeed's own gradient all-reduce: no ZeRO (one flattened
        all-reduce of whole gradients per bucket), fp32 gradients and communication, no expert parallelism."""
        ds = self.ds
        return (collective.is_distributed() and not ds.zero_optimization() and not ds.fp16_enabled()
                and not ds.bfloat16_enabled() and getattr(ds, "communication_data_type", None) == torch.float32
                and not getattr(ds, "has_moe_layers", False) and callable(getattr(ds, "allreduce_bucket", None)))

    def _wrap_allreduce_bucket(self) -> None:
        """Wrap this engine's ``allreduce_bucket(bucket, group, world)``, which flattens a list of gradients,
        all-reduces the flat tensor and returns it (DeepSpeed then copies each gradient back from its offset, so a
        tail after them is ignored): the first fp32 bucket of the boundary gets the window's numbers appended."""
        original = self.ds.allreduce_bucket

        def allreduce_bucket(bucket, dp_group, dp_world_size=None):
            stats = self._pending
            if stats is None or bucket[0].dtype != torch.float32 or bucket[0].is_sparse:
                return original(bucket, dp_group, dp_world_size)
            self._pending = None
            out = original([*bucket, stats.to(bucket[0].device)], dp_group, dp_world_size)
            self._carried = out[-stats.numel():].clone()  # the flat bucket is DeepSpeed's to free
            return out

        self.ds.allreduce_bucket = allreduce_bucket

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        """Hand the window's numbers to the boundary's gradient all-reduce where they can ride in it; else start
        summing them before the last backward, unless they will be folded with the partition norm after it (one
        small all-reduce per step either way)."""
        self._stats_work = None
        if self._carry:
            self._stats = self._pending = stats
            self._carried = None  # never a previous window's sums
            return
        self._stats = stats.to(collective.comm_device())
        if not (want_norm and self._partitioned):
            self._stats_work = collective.all_sum_async(self._stats, group=self._stats_group)

    def _take_carried(self, stats: torch.Tensor) -> torch.Tensor:
        """The numbers summed inside the gradient all-reduce, undivided; summed now if no fp32 bucket came (every
        rank reduces the same buckets, so every rank takes the same branch)."""
        carried, self._carried, self._pending = self._carried, None, None
        if carried is None:
            return collective.all_sum(stats.to(collective.comm_device()), group=self._stats_group)
        return carried * self.world_size if self.averages_over_world else carried

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed window numbers, squared global norm of the reduced, un-normalised gradient if wanted)."""
        stats, self._stats = self._stats, None
        if self._carry:
            stats = self._take_carried(stats)
        if not want_norm:
            if self._stats_work is not None:
                self._stats_work.wait()
            return stats, None
        tensors, partitioned = self._grad_storage()
        self._check_shapes(tensors)
        squared = squared_norm(tensors, stats.device)
        scale = self._loss_scale()
        if scale != 1.0:
            squared = squared / scale ** 2
        if partitioned and collective.is_distributed():
            # partitions are disjoint: their squares add up to the full gradient's; summed with the stats
            both = collective.all_sum(torch.cat([stats, squared.reshape(1)]), group=self._stats_group)
            return both[:-1], both[-1]
        if self._stats_work is not None:
            self._stats_work.wait()
        return stats, squared

    def _check_shapes(self, tensors: list[torch.Tensor]) -> None:
        if not self._shapes_checked:
            check_storage_shapes(self.ds.optimizer, tensors)
            self._shapes_checked = True

    def on_window(self, factor: int, micro_batches: int, samples: int) -> None:
        """Called by the engine before :meth:`step`: keep DeepSpeed's batch bookkeeping true for this window."""
        micro = int(self.ds.train_micro_batch_size_per_gpu())
        if self.ds.gradient_accumulation_steps() != factor:
            self.ds.set_train_batch_size(micro * factor * self.world_size)
        self._window_samples = int(samples)

    def step(self, coef: float, max_norm: float | None, norm: float | None, skip: bool, lr_scale: float = 1.0) -> None:
        """Scale the partitions by ``coef`` (and torch's clipping factor), then let DeepSpeed step.

        ``lr_scale`` multiplies the learning rate of this update only (LR coupling); DeepSpeed's scheduler, which
        steps inside ``ds.step()`` after the update, never sees it.
        """
        samples_before = self.ds.global_samples
        fold = 1.0  # fp16: the scale applied inside DeepSpeed's fp32 unscale rather than to fp16 storage
        if not skip:
            scale = gradient_scale(coef, max_norm, norm)
            if self._fold_into_unscale:
                fold = scale
            elif scale != 1.0:
                tensors, _ = self._grad_storage()
                self._check_shapes(tensors)
                scale_gradients(tensors, scale)
        inner = getattr(self.ds, "basic_optimizer", None) or self.ds.optimizer  # the torch optimizer DeepSpeed wraps
        fp16 = self._fold_into_unscale
        with _inner_step(inner, skip=skip, lr_scale=lr_scale), _fp32_unscale(self.ds.optimizer, fold), \
                _held(self.ds.lr_scheduler, skip and fp16):
            self.ds.step()
        # fp16: a skipped window is an overflow (or empty) and the LR schedule waits, DeepSpeed's own (which skips
        # itself on overflow) and ours alike, as the torch GradScaler path does. Otherwise a skipped step (non-finite
        # with nonfinite='skip') is still one LR step: DeepSpeed's overflow check skipped its scheduler, step it.
        if skip and not fp16 and getattr(self.ds.optimizer, "overflow", False) and self.ds.lr_scheduler is not None:
            self.ds.lr_scheduler.step()
        if self._window_samples is not None:
            self.ds.global_samples = samples_before + self._window_samples
            self._window_samples = None
        if self.lr_scheduler is not None and not (skip and fp16):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.step()

    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def param_groups(self) -> list:
        """The wrapped torch optimizer's groups: its step reads lr, betas and weight decay from them."""
        return (getattr(self.ds, "basic_optimizer", None) or self.ds.optimizer).param_groups

    # -- an open window (stopped inside it): accum_sched.backends.deepspeed_window --------------------------------
    def local_grads(self) -> dict:
        """This rank's accumulated gradient of an open window, where DeepSpeed keeps it at this ZeRO stage."""
        if self.open_window_refused is not None:
            raise NotImplementedError(f"DeepSpeed cannot save an open window here: {self.open_window_refused}")
        return deepspeed_window.save(self.ds)

    def local_grad_tensors(self) -> list[torch.Tensor]:
        return deepspeed_window.tensors(self.ds)

    def load_local_grads(self, grads) -> None:
        if self.open_window_refused is not None:
            raise ValueError(f"this DeepSpeed engine cannot continue an open window: {self.open_window_refused}; "
                             f"resume with the DeepSpeed configuration that saved it")
        deepspeed_window.load(self.ds, grads)

    def noise_params(self) -> list:
        """The DeepSpeed module's parameters, when its local gradient is at hand (ZeRO-0 in fp32); ValueError
        otherwise."""
        ds = self.ds
        stage = int(ds.zero_optimization_stage())
        if stage != 0 or ds.bfloat16_enabled() or ds.fp16_enabled():
            raise ValueError(f"noise_scale with DeepSpeed needs ZeRO stage 0 in fp32 (this engine: stage {stage}"
                             f"{', bf16' if ds.bfloat16_enabled() else ''}{', fp16' if ds.fp16_enabled() else ''}): "
                             f"elsewhere DeepSpeed reduces or partitions the gradient where the local one is not "
                             f"handed out; use stage 0 or the DDP back end")
        return list(ds.module.parameters())


_MISSING = object()
SUPPORTED = "0.19.x"  # the DeepSpeed versions whose internals check_internals() describes


class DeepSpeedInternalsChanged(RuntimeError):
    """DeepSpeed's internals differ from what this back end reads and writes: it would scale gradients wrongly."""


def _internals_error(what: str) -> DeepSpeedInternalsChanged:
    try:
        import deepspeed

        version = deepspeed.__version__
    except Exception:  # noqa: BLE001 - the message must still come out
        version = "(version unknown)"
    return DeepSpeedInternalsChanged(f"DeepSpeed {version}: {what}; accum_sched's DeepSpeed back end relies on the "
                                     f"internals of DeepSpeed {SUPPORTED} and would train wrong: install "
                                     f"deepspeed>=0.19.8,<0.20")


def check_internals(ds_engine) -> None:
    """Stop at set-up, with a one-line error naming DeepSpeed's version, if an internal this back end reads or writes
    is missing or of another kind: engine methods and counters, the optimizer wrapper class, its gradient storage."""
    for name in ("set_gradient_accumulation_boundary", "managed_gradient_accumulation", "gradient_accumulation_steps",
                 "set_train_batch_size", "train_micro_batch_size_per_gpu", "get_lr", "step", "backward"):
        if not callable(getattr(ds_engine, name, None)):
            raise _internals_error(f"DeepSpeedEngine.{name}() is missing")
    if not isinstance(getattr(ds_engine, "global_samples", None), int):
        raise _internals_error("DeepSpeedEngine.global_samples is not an int counter")
    zero12, zero3, bf16_opt, fp16_opt = _optimizer_classes()
    opt = ds_engine.optimizer
    expected = [(zero12, "averaged_gradients", dict), (zero3, "averaged_gradients", dict),
                (bf16_opt, "fp32_groups_gradients_flat", list), (fp16_opt, "fp16_groups", list)]
    for cls, attr, kind in expected:
        if isinstance(opt, cls):
            if not isinstance(getattr(opt, attr, None), kind):
                raise _internals_error(f"{type(opt).__name__}.{attr} is not a {kind.__name__}")
            return
    if ds_engine.zero_optimization() or not isinstance(opt, torch.optim.Optimizer):
        raise _internals_error(f"the optimizer wrapper {type(opt).__name__} is not one this back end knows "
                               f"(DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer, "
                               f"FP16_Optimizer, FP16_UnfusedOptimizer or a plain torch optimizer without ZeRO)")


def check_storage_shapes(opt, tensors: list[torch.Tensor]) -> None:
    """At the first boundary: the gradient storage holds exactly as many elements as the optimizer's (partition of
    the) fp32 master weights, so scaling it scales the whole gradient once."""
    zero12, zero3, bf16_opt, _ = _optimizer_classes()
    if isinstance(opt, zero12):
        master, what = getattr(opt, "single_partition_of_fp32_groups", None), "single_partition_of_fp32_groups"
    elif isinstance(opt, zero3):
        master, what = getattr(opt, "fp32_partitioned_groups_flat", None), "fp32_partitioned_groups_flat"
    elif isinstance(opt, bf16_opt):
        master, what = getattr(opt, "bf16_groups_flat", None), "bf16_groups_flat"
    else:
        return
    if master is None:
        raise _internals_error(f"{type(opt).__name__}.{what} is missing")
    have, want = sum(t.numel() for t in tensors), sum(t.numel() for t in master)
    if have != want:
        raise _internals_error(f"{type(opt).__name__}'s gradient storage holds {have} elements where {what} holds "
                               f"{want}")


@contextlib.contextmanager
def _fp32_unscale(optimizer, scale: float):
    """For one ``ds.step()``, multiply the gradient by ``scale`` inside DeepSpeed's fp32 unscale, not on fp16 storage.

    DeepSpeed's fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer, ZeRO 1/2/3) divide the gradient by their
    ``loss_scale`` in fp32 at step; dividing by ``loss_scale / scale`` instead applies ``scale`` there. The loss
    scaler's own update during the step (x or / its factor) is kept: the scale afterwards is that ratio times the
    scale before.
    """
    current = getattr(optimizer, "loss_scale", None)
    if scale == 1.0 or not current:
        yield
        return
    optimizer.loss_scale = current / scale
    try:
        yield
    finally:
        optimizer.loss_scale = optimizer.loss_scale * scale


@contextlib.contextmanager
def _inner_step(optimizer, *, skip: bool, lr_scale: float):
    """For one ``ds.step()``, make the wrapped torch optimizer's ``step`` a no-op (``skip``: DeepSpeed still clears
    its buffers and counts the step, the weights do not move) or run it at ``lr x lr_scale``."""
    if not skip and lr_scale == 1.0:
        yield
        return
    original = optimizer.step

    def step(*args, **kwargs):
        if skip:
            return None
        with scaled_lr(optimizer, lr_scale):  # the rule every back end shares (accum_sched.step_rules)
            return original(*args, **kwargs)

    with _shadow_step(optimizer, step):
        yield


@contextlib.contextmanager
def _held(scheduler, hold: bool):
    """For one ``ds.step()``, keep DeepSpeed from stepping its LR scheduler (an fp16 window skipped for a reason
    DeepSpeed's own overflow check did not see, e.g. an empty window)."""
    if not hold or scheduler is None:
        yield
        return
    with _shadow_step(scheduler, lambda *args, **kwargs: None):
        yield


@contextlib.contextmanager
def _shadow_step(obj, step):
    """An instance attribute ``step`` shadows the class method (and any wrapper a torch LR scheduler installed on
    the instance, restored after)."""
    saved = obj.__dict__.get("step", _MISSING)
    obj.step = step
    try:
        yield
    finally:
        if saved is _MISSING:
            del obj.step
        else:
            obj.step = saved


def consolidated_state_dict(ds_engine, rank0_only: bool = True) -> dict | None:
    """A plain fp32 ``state_dict`` of ``ds_engine.module`` at any ZeRO stage, gathered from the partitions.

    Trainable parameters come from DeepSpeed's fp32 master copy where there is one (ZeRO 1/2/3, bf16), so a bf16
    run yields its full-precision weights. A collective: call it on every rank. Returns the dict on rank 0 (on every
    rank when ``rank0_only`` is False) and None elsewhere.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param

    module = ds_engine.module
    full: dict[int, torch.Tensor] = {}
    for param in module.parameters():
        if id(param) in full:
            continue
        value = None
        # A collective on every rank: _hp_mapping is None where this rank holds no fragment, but it exists.
        if param.requires_grad and (hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")):
            value = safe_get_full_fp32_param(param)
        if value is None:
            with GatheredParameters([param], modifier_rank=None, enabled=hasattr(param, "ds_id")):
                value = param.detach().clone()
        full[id(param)] = value.detach().float().cpu().clone()
    keep = not rank0_only or collective.rank() == 0
    if not keep:
        return None
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in full:
            out[name] = full[id(tensor)]
        else:  # a buffer: DeepSpeed never partitions those; bf16 runs cast floating ones, so bring them back to fp32
            value = tensor.detach().cpu().clone()
            out[name] = value.float() if value.is_floating_point() else value
    return out


__all__ = ["DeepSpeedBackend", "consolidated_state_dict", "ensure_torch_extensions_dir"]
