"""The noise-scale part of `accum-sched report`: RUN_DIR/noise_scale.png and a summary line, for runs with
`accumulation.noise_scale` (or `adaptive`). JSON in, no torch; matplotlib only inside render_noise().

The noise scale B_noise = EMA(tr Sigma) / EMA(|G|^2) is in elements (samples, or tokens for a language model), so it
is drawn against the batch the optimizer saw in the same unit: each window's elements over all ranks
(``gns_b_global``). Where the batch sits below B_noise a larger one would have saved steps almost for free; above it,
samples are spent for little gain (McCandlish et al. 2018).
"""
from __future__ import annotations

import math

from launcher.report import render as report


def has_noise(history: report.History) -> bool:
    return any("gns_b_global" in s for s in history.steps)


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def summary_line(history: report.History) -> str:
    """One line for report.txt: the smoothed noise scale at the start and at the end, and the batch at the end."""
    measured = [s for s in history.steps if _finite(s.get("noise_scale"))]
    if not measured:
        return "noise scale       no estimate (needs two batch sizes: several ranks, or windows of 2+ micro-batches)\n"
    first, last = measured[0], measured[-1]
    batch = history.steps[-1].get("gns_b_global")
    return (f"noise scale       {first['noise_scale']:.4g} at step {first['step']} -> {last['noise_scale']:.4g} at "
            f"step {last['step']} (elements); last batch {batch:g} elements\n")


def render_noise(history: report.History, path: str, title: str) -> None:
    """Write the noise-scale figure (PNG): B_noise next to the batch per step; the two EMAs it is the ratio of."""
    _, Figure, FigureCanvasAgg = report._load_matplotlib(path)
    steps = history.column("step")
    noise = [v if _finite(v) and v > 0 else float("nan") for v in history.column("noise_scale")]
    batch = [float(v) if _finite(v) else float("nan") for v in history.column("gns_b_global")]
    fig = Figure(figsize=(13, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_noise, ax_parts = fig.subplots(1, 2)

    ax_noise.plot(steps, noise, color="tab:red", linewidth=1.6, label="noise scale EMA(tr Σ)/EMA(|G|²)")
    ax_noise.step(steps, batch, where="pre", color="tab:green", linewidth=1.4, label="batch per step (elements)")
    ax_noise.set_yscale("log")
    ax_noise.set_xlabel("optimizer step")
    ax_noise.set_ylabel("elements (samples or tokens)")
    ax_noise.set_title("Gradient noise scale and the batch the optimizer saw", fontsize=11)
    ax_noise.grid(True, alpha=0.3, which="both")
    reasons = history.column("factor_reason")
    changes = [s["step"] - 1 for prev, s in zip(history.steps, history.steps[1:]) if s["factor"] != prev["factor"]]
    for x in changes:
        ax_noise.axvline(x, color="tab:green", linestyle="--", linewidth=0.8, alpha=0.7)
    if changes:
        adaptive = any(r is not None for r in reasons)
        ax_noise.plot([], [], color="tab:green", linestyle="--", linewidth=0.8,
                      label="factor change (adaptive)" if adaptive else "factor change")
    ax_noise.legend(loc="best", fontsize=8)

    for key, color, label in (("gns_trace_ema", "tab:purple", "EMA of tr Σ estimate"),
                              ("gns_grad_sq_ema", "tab:blue", "EMA of |G|² estimate")):
        values = [v if _finite(v) and v > 0 else float("nan") for v in history.column(key)]
        ax_parts.plot(steps, values, color=color, linewidth=1.4, label=label)
    ax_parts.set_yscale("log")
    ax_parts.set_xlabel("optimizer step")
    ax_parts.set_title("The two smoothed estimates (McCandlish et al. 2018, App. A.1)", fontsize=11)
    ax_parts.grid(True, alpha=0.3, which="both")
    ax_parts.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=100)
