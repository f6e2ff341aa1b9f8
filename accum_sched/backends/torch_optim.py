"""Gradients in ``param.grad``, stepped by a torch optimizer: the shared base of the one-process, DDP and FSDP2
back ends (:mod:`.single`, :mod:`.ddp`, :mod:`.fsdp`). The rules they share with DeepSpeed (clipping, LR coupling,
the fused norm) are in :mod:`accum_sched.step_rules`.
"""
from __future__ import annotations

import warnings

import torch

from accum_sched.backends.base import Backend, Capabilities, check_precision, module_device
from accum_sched.step_rules import NO_CONTEXT, gradient_scale, scale_gradients, scaled_lr, squared_norm


class TorchBackend(Backend):
    """Gradients live in ``param.grad`` and a torch optimizer steps them; in one process nothing is reduced."""

    name = "one process"
    capabilities = Capabilities(stop_mid_window=True, prescale=True, fp16="grad_scaler", noise_scale="micro_batch")
    #: True when the gradient collective averages over ranks (DDP), so the engine multiplies by world size.
    averages_over_world = False

    def __init__(self, model: torch.nn.Module, optimizer, lr_scheduler=None, *, precision: str = "fp32"):
        if optimizer is None:
            raise ValueError("optimizer is required for a torch model (only a DeepSpeed engine brings its own)")
        self.precision = check_precision(precision)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        # fp16: a torch GradScaler ("cpu" works too, torch >= 2.3)
        self.scaler = torch.amp.GradScaler(module_device(model).type) if precision == "fp16" else None
        self._unscaled = False  # the scaler's unscale_ ran on this window's gradient
        self._verdict_read = False  # scaler_verdict() handed the found-inf flag to the step's one host read
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
        self._unscale()
        return squared_norm(self._grads())

    def _unscale(self) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)  # divides by the scale and records found-inf: no host sync
            self._unscaled = True

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last backward: (the window's numbers summed over ranks, squared gradient norm if wanted)."""
        stats, self._stats = self._stats, None
        return stats, self._squared_norm() if want_norm else None

    def scaler_verdict(self) -> torch.Tensor | None:
        """fp16: ``(found_inf, scale)`` on the device, for the engine's one read of the step (GradScaler.step would
        read found-inf with an ``.item()`` of its own, get_scale() the scale with another)."""
        if self.scaler is None or not self.scaler.is_enabled():  # a disabled scaler records nothing: step() as is
            return None
        self._unscale()
        # the found-inf flags unscale_ recorded (one per device; update() consumes the same tensors)
        found = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"].values()
        scale = self.scaler._scale  # before update(): the scale this window's backward ran with
        self._verdict_read = True
        return torch.stack([sum(f.to(scale.device, torch.float32) for f in found).reshape(()),
                            scale.reshape(()).float()])

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
                if self.scaler is not None and not self._verdict_read:
                    self.scaler.step(self.optimizer)  # no verdict read: the scaler checks found-inf (a host sync)
                    self._unscaled = True  # step() unscaled if nobody had
                else:  # the engine read found-inf with the window's numbers: not skipped means none was found
                    self.optimizer.step()
        if self.scaler is not None:
            self._unscale()  # a skipped window nobody unscaled still records found-inf for update()
            self.scaler.update()  # the scaler's own rule (backoff on found-inf, growth every growth_interval)
            self._unscaled = self._verdict_read = False
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


__all__ = ["TorchBackend"]
