"""The interface every back end implements, and the capabilities it declares.

The engine (:class:`accum_sched.AccumulationEngine`) decides *when* a window ends and *by how much* its gradient must be
scaled; a back end knows *how* to keep non-boundary micro-batches local, how to backward, how the window's numbers
are summed over ranks, and how to scale, clip and step. The engine talks to a back end only through :class:`Backend`,
and branches on what a back end can do only through its :class:`Capabilities` (never by its type or an optional
attribute).

One optimizer step, as the engine drives it (per micro-batch ``j`` of a window of ``size``)::

    with backend.sync_context(boundary=j == size - 1):   # around forward AND backward
        ...forward...
        if boundary: backend.send_window_stats(stats, want_norm)
        backend.backward(loss)
    # after the boundary micro-batch:
    stats, squared_norm = backend.window_totals(want_norm)   # device tensors; the engine reads them in one transfer
    backend.on_window(factor, size, samples)
    backend.step(coef, max_norm, norm, skip, lr_scale)
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

FP16_MODES = ("grad_scaler", "native", "refused")
NOISE_PROBES = ("micro_batch", "buckets", "accumulated_grad")


@dataclass(frozen=True)
class Capabilities:
    """What a back end can do; the engine reads these instead of probing for attributes.

    A class declares its defaults as ``capabilities``; an instance may replace them in ``__init__`` where they depend
    on the model (DDP: whether its comm hook could be registered, the buckets' dtype).
    """

    #: ``local_grads``/``local_grad_tensors``/``load_local_grads`` work, so a stop may leave a window open
    #: (engine ``stop_at="micro_batch"``); otherwise the engine stops at the boundary.
    stop_mid_window: bool
    #: The engine may multiply every loss of a window by one constant (1 / the full window's element count), so a
    #: full window needs no pass over the gradient at the step (AccumulationEngine._window_prescale).
    prescale: bool
    #: ``precision="fp16"``: ``"grad_scaler"`` (the back end runs a torch GradScaler, ``backend.scaler``),
    #: ``"native"`` (the wrapped engine scales its own loss: DeepSpeed) or ``"refused"`` (construction fails).
    fp16: str
    #: How the gradient noise scale reads this rank's local gradient with more than one rank: ``"buckets"`` (comm
    #: hook callbacks, :meth:`Backend.observe_buckets`), ``"accumulated_grad"`` (post-accumulate-grad hooks that read
    #: :attr:`Backend.at_boundary`); one rank always uses ``"micro_batch"`` (a hook per parameter). None: refused.
    noise_scale: str | None
    #: The window's numbers ride inside the gradient collective of the boundary backward (no collective of their
    #: own); otherwise they take one small all-reduce per optimizer step (or none, in one process).
    stats_in_gradient_collective: bool = False

    def __post_init__(self):
        if self.fp16 not in FP16_MODES:
            raise ValueError(f"Capabilities.fp16={self.fp16!r} is not one of {', '.join(FP16_MODES)}")
        if self.noise_scale is not None and self.noise_scale not in NOISE_PROBES:
            raise ValueError(f"Capabilities.noise_scale={self.noise_scale!r} is not one of {', '.join(NOISE_PROBES)}")


PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(precision: str) -> str:
    """``precision`` if it is one the back ends know (one ValueError line otherwise)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


class Backend(abc.ABC):
    """How gradients meet, for one kind of model. Constructed as ``cls(model, optimizer, lr_scheduler, *,
    precision=..., <its own options>)``, by the caller (``AccumulationEngine(..., backend=...)``) or by
    :func:`accum_sched.backends.make_backend`; raises ValueError (one line, with a hint) for what it refuses. Each
    class takes its own options as keywords: shared code knows only ``precision``.

    Attributes every back end sets: ``precision`` (the engine's autocast follows it), ``world_size`` (ranks the
    gradient is reduced over), ``averages_over_world`` (the gradient collective divides by the world size, so the
    engine multiplies by it), ``stats_dtype`` (dtype the window's numbers are encoded in,
    :mod:`accum_sched.window_stats`), ``scaler`` (a torch GradScaler or None) and ``capabilities``.
    """

    #: A short human name for messages ("DDP", "FSDP2").
    name: str = "back end"
    precision: str = "fp32"
    capabilities: Capabilities
    world_size: int = 1
    averages_over_world: bool = False
    stats_dtype: torch.dtype = torch.float64
    scaler = None
    #: Whether the micro-batch in flight closes its window, as the last :meth:`sync_context` said. Kept only by back
    #: ends whose ``capabilities.noise_scale`` is ``"accumulated_grad"`` (read by that probe's hooks during backward).
    at_boundary: bool

    # -- per micro-batch (the hot path: no host sync, no allocation beyond the backward's own) -------------------
    @abc.abstractmethod
    def sync_context(self, boundary: bool):
        """Called before each micro-batch's forward; the engine enters the returned context around forward AND
        backward. Only the boundary micro-batch (``boundary=True``) may reduce gradients over ranks."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (already multiplied by the engine's per-window constant) into the window's
        gradient, adding to what earlier micro-batches of the window left."""

    # -- per window ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        """Called just before the boundary backward with this rank's encoded window numbers (``stats_dtype``).
        Start summing them over ranks (inside the gradient collective, or overlapping the backward); ``want_norm``
        says whether :meth:`window_totals` will be asked for the norm."""

    @abc.abstractmethod
    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the boundary backward: (the window's numbers summed over ranks, the squared global L2 norm of the
        reduced, not yet normalised gradient if ``want_norm`` else None). Device tensors; must not wait for the
        device (the engine reads both in its one host transfer of the step). Identical on every rank."""

    def scaler_verdict(self) -> torch.Tensor | None:
        """After :meth:`window_totals`, with a torch GradScaler in ``scaler``: a device tensor ``(found_inf, scale)``
        (found_inf non-zero when the unscaled, reduced gradient holds an inf or NaN; the scale the window was scaled
        with), read in the step's one host transfer; :meth:`step` then trusts ``skip`` instead of the scaler's own
        found-inf read. None without a GradScaler."""
        return None

    def on_window(self, factor: int, micro_batches: int, samples: int) -> None:
        """Called once per window, before :meth:`step`, with its scheduled factor, micro-batches and global samples
        (for back ends with batch bookkeeping of their own: DeepSpeed's GAS and ``global_samples``)."""

    @abc.abstractmethod
    def step(self, coef: float, max_norm: float | None, norm: float | None, skip: bool, lr_scale: float = 1.0) -> None:
        """Multiply the window's gradient by ``coef`` (and the clipping factor for ``max_norm``, see
        :func:`accum_sched.step_rules.gradient_scale`), step the optimizer at ``lr x lr_scale`` for this step only,
        step the LR scheduler, clear the gradient. ``skip``: no update (non-finite or empty window), but the
        gradient is cleared and the counters move as the back end's rules say."""

    @abc.abstractmethod
    def lr(self) -> float:
        """The learning rate the next step uses (before the engine's LR coupling)."""

    def param_groups(self) -> list:
        """The param groups of the torch optimizer that steps (its lr, betas and weight decay are read for metrics
        and for co-scaling, accum_sched.co_scale)."""
        return self.optimizer.param_groups

    def native_loss_scale(self) -> float | None:
        """The loss scale of this window when the back end runs its own dynamic fp16 loss scaling (DeepSpeed's
        fp16 optimizers), else None (no fp16, or a torch GradScaler in ``scaler``). With a scale, a non-finite
        gradient is an overflow: a counted skip that holds every LR scheduler, as with the GradScaler."""
        return None

    # -- an open window (only with capabilities.stop_mid_window) ------------------------------------------------
    def local_grads(self) -> list:
        """This rank's accumulated, not yet reduced, gradient of an open window: one CPU tensor (or None) per
        optimizer parameter (saved in the engine's state_dict; differs per rank)."""
        raise NotImplementedError(f"{self.name} cannot save an open window (capabilities.stop_mid_window)")

    def local_grad_tensors(self) -> list[torch.Tensor]:
        """The open window's local gradients in place (the engine rescales them after a resume)."""
        raise NotImplementedError(f"{self.name} cannot save an open window (capabilities.stop_mid_window)")

    def load_local_grads(self, grads: list) -> None:
        """Put back what :meth:`local_grads` returned (ValueError if it does not fit the optimizer)."""
        raise NotImplementedError(f"{self.name} cannot load an open window (capabilities.stop_mid_window)")

    # -- checkpoints and counters -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The back end's own resumable state (plain values), saved inside the engine's state_dict."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (``{}`` for a checkpoint without one)."""

    @property
    def allreduce_rounds(self) -> int | None:
        """Gradient collective rounds launched so far (a backward that reduced counts once); None: not counted."""
        return None

    @property
    def allreduce_bytes(self) -> int | None:
        """Bytes of gradient handed to the collective so far; None: not counted."""
        return None

    # -- measurements (the gradient noise scale) ----------------------------------------------------------------
    def noise_params(self) -> list:
        """The parameters whose local gradients the noise-scale probe reads (ValueError where they are not at
        hand); called once, when ``noise_scale`` is on."""
        return list(self.model.parameters())

    def observe_buckets(self, before: Callable, after: Callable) -> bool:
        """Call ``before(bucket)`` ahead of every gradient bucket's all-reduce and ``after(bucket, reduced)`` once
        it is reduced (comm hook thread, must not wait for the device); False where there are no such buckets."""
        return False


def module_device(model) -> torch.device:
    """Where ``model``'s first parameter lives (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


__all__ = ["PRECISIONS", "Backend", "Capabilities", "check_precision", "module_device"]
