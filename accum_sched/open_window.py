"""OpenWindow: this rank's share of the window being accumulated, and its saved form after a stop inside it.

The engine adds each micro-batch's detached loss and element count here (no tensor operation, no device sync: the
losses are summed once, at the window's end) and the batch's samples. A stop inside a window (``stop_at=
"micro_batch"``) saves these numbers with the back end's local gradients (:meth:`state_dict`); a resume puts them
back and the window goes on where it stopped.
"""
from __future__ import annotations

import torch

#: the keys of a saved open window (engine.state_dict()["window"])
KEYS = ("start_micro_batch", "loss_sum", "elements", "samples", "loss_multiplier", "local_grads")


class OpenWindow:
    """The numbers of the window in progress on this rank (all reset by :meth:`close`)."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []  # the window's detached losses, summed once at its end
        self.carried_loss = 0.0  # this rank's loss sum of a window left open by a stop (resumed)
        self.elements: int | torch.Tensor | None = None  # element count: an int, or a tensor if the loss gave one
        self.samples = 0
        self.start: int | None = None  # micro-batch (in its epoch) where a window left open by a stop began
        self.saved_multiplier: float | None = None  # the loss multiplier a resumed window's gradients carry

    @property
    def is_open(self) -> bool:
        return self.elements is not None

    def add(self, loss_sum: torch.Tensor, n_elements) -> None:
        """One micro-batch's loss sum and element count, kept where they are (a device tensor stays there)."""
        loss = loss_sum.detach()
        self.losses.append(loss.reshape(()) if loss.dim() else loss)
        self.elements = n_elements if self.elements is None else self.elements + n_elements

    def loss_sum(self) -> torch.Tensor:
        """This rank's sum of the window's losses, on the losses' device: the loss itself for a window of one
        micro-batch, else one float64 sum (two tensor operations per window, none per micro-batch)."""
        losses = self.losses
        if len(losses) == 1 and not self.carried_loss:
            return losses[0]
        if not losses:
            return torch.tensor(self.carried_loss, dtype=torch.float64)
        total = torch.stack(losses).sum(dtype=torch.float64)
        return total + self.carried_loss if self.carried_loss else total

    def close(self) -> None:
        """The window was stepped: nothing of it remains."""
        self.losses, self.elements, self.carried_loss, self.samples = [], None, 0.0, 0

    def state_dict(self, loss_multiplier: float, local_grads) -> dict:
        """The open window as saved (per rank): where it began, this rank's loss sum, elements and samples, the loss
        multiplier its gradients were accumulated with, and the back end's local gradients."""
        return {"start_micro_batch": self.start, "loss_sum": float(self.loss_sum()),
                "elements": float(self.elements), "samples": self.samples, "loss_multiplier": loss_multiplier,
                "local_grads": local_grads}

    def load_state_dict(self, state: dict | None):
        """Put back a saved window (None: none was open); returns its local gradients for the back end, or None."""
        self.losses = []
        if state is None:
            self.start, self.carried_loss, self.saved_multiplier, self.elements, self.samples = None, 0.0, None, None, 0
            return None
        missing = [key for key in KEYS if key not in state]
        if missing:
            raise ValueError(f"the saved open window lacks {', '.join(missing)}: it was written by an earlier "
                             f"development version of accum_sched; resume from a checkpoint taken at a window "
                             f"boundary, or start afresh")
        self.start = int(state["start_micro_batch"])
        self.carried_loss = float(state["loss_sum"])
        self.saved_multiplier = float(state["loss_multiplier"])
        self.elements = torch.tensor(state["elements"], dtype=torch.float64)
        self.samples = int(state["samples"])
        return state["local_grads"]


__all__ = ["KEYS", "OpenWindow"]
