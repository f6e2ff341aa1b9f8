"""StepInfo: what one optimizer step did (handed to ``on_step`` callbacks; one metrics.jsonl line)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepInfo:
    """What happened at one optimizer step (handed to ``on_step`` callbacks; one metrics.jsonl line)."""

    epoch: int
    step: int  # optimizer steps completed, this one included
    factor: int  # the scheduled factor of this window
    micro_batches: int  # micro-batches in this window (< factor for a partial window)
    elements: int  # elements (samples or tokens) in this window over all ranks
    samples: int  # samples in this window over all ranks
    loss: float  # mean loss per element over the window, all ranks
    lr: float  # learning rate used by this step
    grad_norm: float | None  # global norm of the normalised gradient, before clipping; None where not measured
    skipped: bool  # non-finite loss/gradient: the optimizer did not step
    loss_scale: float | None = None  # fp16: the GradScaler scale this window was scaled with (None otherwise)
    noise: dict | None = None  # noise_scale=True: the gns_* fields and noise_scale (accum_sched.noise_scale.FIELDS)
    factor_reason: str | None = None  # adaptive: why this window has its factor (the decision that set it)
    beta2: float | None = None  # Adam's beta2 this step ran with (co-scaled where asked); None: no betas
    weight_decay: float | None = None  # weight decay this step ran with (co-scaled where asked); None: no such setting

    def to_dict(self) -> dict:
        """One flat metrics line; the optional fields appear only when their feature is on."""
        out = asdict(self)
        noise, reason = out.pop("noise"), out.pop("factor_reason")
        out.update(noise or {})
        if reason is not None:
            out["factor_reason"] = reason
        return out

    @classmethod
    def from_dict(cls, record: dict) -> StepInfo:
        """The inverse of to_dict (a checkpoint's last step)."""
        from accum_sched.noise_scale import FIELDS  # torch: this module stays importable without it

        known = {f.name for f in fields(cls)} - {"noise"}
        noise = {k: record[k] for k in FIELDS if k in record} or None
        return cls(**{k: v for k, v in record.items() if k in known}, noise=noise)


__all__ = ["StepInfo"]
