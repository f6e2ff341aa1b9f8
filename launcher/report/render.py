"""The picture and text summary of a finished (or running) run, from its metrics.jsonl, eval.jsonl (when the run
evaluated) and summary.json.

Pure functions over parsed JSON, so they are testable without a run and never import torch; matplotlib is imported
only inside `render()` (it is the optional `report` extra).

Reading metrics.jsonl: the worker writes one line per optimizer step; on --resume it first cuts the file back to
the checkpoint's step, and a resumed session's wall_time restarts at 0. `parse_metrics` still rebuilds one timeline
from a file where the step count goes back (lines gathered by hand, older runs): the lines from that step on are
replaced by the newer ones, so a step is always its last line.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from launcher.errors import ConfigError

# Fields every metrics line must carry for the report (see launcher/train/metrics.py and accum_sched.engine.StepInfo).
REQUIRED = ("epoch", "step", "factor", "samples", "loss", "lr", "skipped")


@dataclass
class History:
    """The kept timeline, one record per optimizer step in step order, and how it was pieced together."""

    steps: list[dict]
    resumed_at: list[int] = field(default_factory=list)  # first step written by each resumed session
    sessions: list[list[float]] = field(default_factory=list)  # wall_time values of each kept session, in order
    dropped_runs: int = 0  # earlier fresh runs into the same directory, not reported
    torn_last_line: bool = False  # an unfinished last line (a worker killed mid-write), ignored

    def column(self, key: str) -> list:
        return [s.get(key) for s in self.steps]


def parse_metrics(lines, where: str = "metrics.jsonl") -> History:
    """Parse metrics.jsonl text lines into a History (see the module docstring). Raises ConfigError(where, ...)."""
    lines = list(lines)
    while lines and not lines[-1].strip():
        lines.pop()
    steps: list[dict] = []
    resumed_at: list[int] = []
    sessions: list[list[float]] = []
    dropped = 0
    torn = False
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)  # Python's json reads the NaN/Infinity that a skipped step writes
        except json.JSONDecodeError as exc:
            if number == len(lines):
                torn = True
                break
            raise ConfigError(where, f"line {number} is not JSON ({exc.msg})",
                              "the file is damaged; delete the bad line or rerun the training") from None
        if not isinstance(rec, dict):
            raise ConfigError(where, f"line {number} is not a JSON object", "the file is damaged; rerun the training")
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ConfigError(where, f"line {number} lacks {', '.join(missing)}",
                              "it was not written by accum-sched run (or by an older version); rerun the training")
        step, wall = int(rec["step"]), rec.get("wall_time")
        new_session = not sessions
        if steps and (step <= steps[-1]["step"] or (wall is not None and sessions[-1] and wall < sessions[-1][-1])):
            new_session = True
            if step <= 1:  # a fresh run into the same directory: nothing before it belongs to this run
                dropped += 1
                steps, resumed_at, sessions = [], [], []
            else:  # a resume: the timeline rewinds to the checkpoint, newer lines replace older ones
                while steps and steps[-1]["step"] >= step:
                    steps.pop()
                resumed_at.append(step)
        if new_session:
            sessions.append([])
        steps.append(rec)
        if wall is not None:
            sessions[-1].append(float(wall))
    return History(steps, resumed_at, sessions, dropped, torn)


def parse_evals(lines, where: str = "eval.jsonl") -> list[dict]:
    """Parse eval.jsonl lines (one per evaluation, launcher/train/validation.py). An unfinished last line is ignored; a
    step that goes back (lines gathered from several sessions by hand) replaces what came after it."""
    lines = [text for text in lines if text.strip()]
    records: list[dict] = []
    for number, text in enumerate(lines, 1):
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ConfigError(where, f"line {number} is not JSON ({exc.msg})",
                              "the file is damaged; delete the bad line or rerun the training") from None
        if not isinstance(rec, dict) or not all(k in rec for k in ("epoch", "step", "val_loss")):
            raise ConfigError(where, f"line {number} lacks epoch, step or val_loss",
                              "it was not written by accum-sched run; move it away to report without it")
        while records and records[-1]["step"] >= rec["step"]:
            records.pop()
        records.append(rec)
    return records


def best_eval(evals: list[dict], monitor: str = "val_loss", mode: str = "min") -> dict | None:
    """The first evaluation with the best finite value of ``monitor``."""
    finite = [e for e in evals if isinstance(e.get(monitor), (int, float)) and math.isfinite(e[monitor])]
    if not finite:
        return None
    pick = min if mode == "min" else max
    return pick(finite, key=lambda e: e[monitor])


@dataclass
class Segment:
    """A stretch of consecutive optimizer steps with one factor: the schedule as it was actually applied."""

    first_epoch: int
    last_epoch: int
    first_step: int
    last_step: int
    factor: int
    effective_batch: int | None
    steps: int


def applied_schedule(history: History) -> list[Segment]:
    segments: list[Segment] = []
    for rec in history.steps:
        last = segments[-1] if segments else None
        if last is not None and last.factor == rec["factor"]:
            last.last_epoch, last.last_step, last.steps = rec["epoch"], rec["step"], last.steps + 1
        else:
            segments.append(Segment(rec["epoch"], rec["epoch"], rec["step"], rec["step"], rec["factor"],
                                    rec.get("effective_batch"), 1))
    return segments


def epoch_boundaries(history: History) -> list[tuple[int, int, int]]:
    """(epoch, steps completed before it, samples seen before it) for each epoch that has a step."""
    out, steps_before, samples = [], 0, 0
    for rec in history.steps:
        if not out or rec["epoch"] != out[-1][0]:
            out.append((rec["epoch"], steps_before, samples))
        steps_before, samples = rec["step"], samples + rec["samples"]
    return out


def cumulative(values) -> list[float]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def rolling_mean(values, window: int) -> list[float]:
    """Centred moving average over finite values (NaN where a window has none); skipped steps do not poison it."""
    half = max(0, window // 2)
    finite = [v if v is not None and math.isfinite(v) else None for v in values]
    sums, counts = [0.0], [0]
    for v in finite:
        sums.append(sums[-1] + (v or 0.0))
        counts.append(counts[-1] + (v is not None))
    out = []
    for i in range(len(finite)):
        lo, hi = max(0, i - half), min(len(finite), i + half + 1)
        n = counts[hi] - counts[lo]
        out.append((sums[hi] - sums[lo]) / n if n else float("nan"))
    return out


def summarize(history: History, summary: dict | None, evals: list[dict] | None = None) -> dict:
    """The numbers of the text summary. Counts come from metrics.jsonl (and eval.jsonl); world size, wall time and
    all-reduce rounds only summary.json knows (the worker writes it at the end, so a running or crashed run has
    none)."""
    steps = history.steps
    last = steps[-1]
    train_seconds = sum(s[-1] for s in history.sessions if s) if any(history.sessions) else None
    samples = sum(s["samples"] for s in steps)
    numbers = {
        "steps": last["step"],
        "skipped": sum(bool(s["skipped"]) for s in steps),
        "epochs_seen": last["epoch"] + 1,
        "samples": samples,
        "final_loss": last["loss"],
        "first_loss": steps[0]["loss"],
        "last_finite": next(((s["step"], s["loss"]) for s in reversed(steps) if math.isfinite(s["loss"])), None),
        "segments": applied_schedule(history),
        "train_seconds": train_seconds,
        "samples_per_s": samples / train_seconds if train_seconds else None,
        "resumed_at": list(history.resumed_at),
        "world_size": None, "backend": None, "epochs": None, "completed_epochs": None, "wall_seconds": None,
        "allreduce_rounds": None, "rounds_per_step": None, "notes": [],
        "eval_last": None, "eval_best": None, "eval_monitor": "val_loss", "eval_mode": "min",
    }
    if evals:
        if summary is not None:
            numbers["eval_monitor"] = summary.get("eval_monitor", "val_loss")
            numbers["eval_mode"] = summary.get("eval_mode", "min")
        numbers["eval_last"] = evals[-1]
        numbers["eval_best"] = best_eval(evals, numbers["eval_monitor"], numbers["eval_mode"])
    if history.dropped_runs:
        numbers["notes"].append(f"metrics.jsonl also holds {history.dropped_runs} earlier run(s) in this directory; "
                                "only the latest is reported")
    gaps = [(a["step"] + 1, b["step"] - 1) for a, b in zip(steps, steps[1:]) if b["step"] != a["step"] + 1]
    if gaps or steps[0]["step"] != 1:
        missing = ([(1, steps[0]["step"] - 1)] if steps[0]["step"] != 1 else []) + gaps
        numbers["notes"].append("metrics.jsonl has no line for step(s) " + ", ".join(
            f"{a}-{b}" if b > a else f"{a}" for a, b in missing) + "; sample counts and curves leave them out")
    if history.torn_last_line:
        numbers["notes"].append("the last line of metrics.jsonl is unfinished (a worker stopped mid-write); ignored")
    if summary is None:
        numbers["notes"].append("no summary.json (the run is still going or did not finish): world size, wall "
                                "time and all-reduce rounds are unknown")
        return numbers
    for key in ("world_size", "backend", "epochs", "completed_epochs", "wall_seconds"):
        numbers[key] = summary.get(key)
    earlier = [s[-1] for s in history.sessions[:-1] if s]
    if numbers["wall_seconds"] is not None and earlier:
        # summary.json times the session that wrote it; the run's wall time adds what the earlier sessions' kept
        # lines took (at least that: their steps after the checkpoint were rewound), never below the training time
        numbers["wall_seconds"] += sum(earlier)
    rounds, total = summary.get("allreduce_rounds"), summary.get("optimizer_steps")
    numbers["allreduce_rounds"] = rounds
    if rounds is not None and total:
        numbers["rounds_per_step"] = rounds / total
    if total is not None and total != numbers["steps"]:
        numbers["notes"].append(f"summary.json counts {total} optimizer steps but metrics.jsonl ends at step "
                                f"{numbers['steps']}: the summary is from another run, or the run is still going")
    return numbers


GAP_NOTES = ("metrics.jsonl has no line for step(s) ", "the last line of metrics.jsonl is unfinished")


def gap_warnings(numbers: dict) -> list[str]:
    """The notes of :func:`summarize` about lines missing from metrics.jsonl (a gap in the steps, a torn last
    line): `accum-sched report` also prints them as warnings, since the counts and curves leave those steps out."""
    return [note for note in numbers["notes"] if note.startswith(GAP_NOTES)]


def _num(value, fmt: str, unknown: str = "unknown") -> str:
    return unknown if value is None else format(value, fmt)


def format_summary(numbers: dict, run_dir: str) -> str:
    n = numbers
    world = _num(n["world_size"], "d")
    if n["backend"]:
        world += f" ({n['backend']})"
    epochs = f"{n['epochs_seen']} so far"
    if n["epochs"] is not None:
        epochs = f"{n['completed_epochs'] if n['completed_epochs'] is not None else n['epochs_seen']} of {n['epochs']}"
        if n["completed_epochs"] is not None and n["epochs_seen"] > n["completed_epochs"]:
            # stopped inside an epoch (run.max_steps, early stop): the picture shows steps of one more epoch
            epochs += f" completed; steps in epochs 0-{n['epochs_seen'] - 1}"
    lines = [
        f"run               {run_dir}",
        f"world size        {world}",
        f"optimizer steps   {n['steps']} ({n['skipped']} skipped)",
        f"epochs            {epochs}",
        f"samples seen      {n['samples']}",
        f"final loss        {n['final_loss']:.6g} (first step {n['first_loss']:.6g})",
    ]
    if not math.isfinite(n["final_loss"]) and n["last_finite"]:
        step, loss = n["last_finite"]
        lines[-1] += f"; the last step was skipped, last finite loss {loss:.6g} at step {step}"
    if n["resumed_at"]:
        lines.append(f"resumed at step   {', '.join(str(s) for s in n['resumed_at'])}")
    lines.append("schedule applied  epochs   steps      factor  eff.batch  optimizer steps")
    for seg in n["segments"]:
        epochs_text = f"{seg.first_epoch}" + (f"-{seg.last_epoch}" if seg.last_epoch != seg.first_epoch else "")
        steps_text = f"{seg.first_step}-{seg.last_step}"
        lines.append(f"                  {epochs_text:<8} {steps_text:<10} {seg.factor:>6}  "
                     f"{_num(seg.effective_batch, 'd', '?'):>9}  {seg.steps:>15}")
    lines += _format_validation(n)
    wall = "unknown" if n["wall_seconds"] is None else f"{n['wall_seconds']:.1f} s"
    if n["wall_seconds"] is not None and len(n["resumed_at"]) > 0:
        wall += f" over {len(n['resumed_at']) + 1} sessions"
    if n["train_seconds"] is not None:
        wall += f" (training {n['train_seconds']:.1f} s, {n['samples_per_s']:.0f} samples/s)"
    lines.append(f"wall time         {wall}")
    rounds = _num(n["allreduce_rounds"], "d")
    if n["rounds_per_step"] is not None:
        rounds += f", {n['rounds_per_step']:.2f} per optimizer step"
    lines.append(f"all-reduce rounds {rounds}")
    lines += [f"note: {note}" for note in n["notes"]]
    return "\n".join(lines) + "\n"


def _format_validation(n: dict) -> list[str]:
    last, best, monitor = n["eval_last"], n["eval_best"], n["eval_monitor"]
    if last is None:
        return []
    out = [f"validation        val_loss {last['val_loss']:.6g} at step {last['step']} (epoch {last['epoch']}), "
           f"{last.get('val_elements', '?')} elements"]
    if best is not None:
        out.append(f"best validation   {monitor} {best[monitor]:.6g} ({n['eval_mode']}) at step {best['step']} "
                   f"(epoch {best['epoch']})")
    return out


def title(numbers: dict, run_dir: str) -> str:
    n = numbers
    parts = [os.path.basename(os.path.normpath(run_dir)) or run_dir]
    if n["world_size"] is not None:
        parts.append(f"{n['backend'] or ''} world size {n['world_size']}".strip())
    parts.append(f"{n['steps']} optimizer steps over {n['epochs_seen']} epochs")
    parts.append(f"final loss {n['final_loss']:.4g}")
    if n["skipped"]:
        parts.append(f"{n['skipped']} skipped")
    return "  ·  ".join(parts)


# -- the picture ----------------------------------------------------------------------------------------------------
def _load_matplotlib(run_dir: str):
    try:
        # optional (accum-sched[report]): `report` says how to install it when missing
        import matplotlib
    except ImportError:
        raise ConfigError(run_dir, "the report needs matplotlib, which is not installed",
                          "pip install 'accum-sched[report]' (or pip install matplotlib)") from None
    # The Agg canvas directly, not pyplot: no display, no global figure state, no backend switch for the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return matplotlib, Figure, FigureCanvasAgg


def _mark_epochs(ax, positions, labels, top_label: bool) -> None:
    """Thin lines at epoch starts; on `top_label` panels a top axis naming the epochs (thinned to ~12 labels)."""
    for x in positions[1:]:
        ax.axvline(x, color="0.75", linewidth=0.7, linestyle=":", zorder=0)
    if top_label and positions:
        every = max(1, math.ceil(len(positions) / 12))
        top = ax.secondary_xaxis("top")
        top.set_xticks(positions[::every], labels=[str(e) for e in labels[::every]])
        top.tick_params(labelsize=7, length=2, pad=1)
        top.set_xlabel("epoch", fontsize=8, labelpad=4)


def render(history: History, numbers: dict, path: str, title: str, evals: list[dict] | None = None) -> None:
    """Write the 2x2 report figure to `path` (PNG): loss vs steps and vs samples (with the validation loss when
    ``evals`` has lines of eval.jsonl), factor / effective batch, LR."""
    _, Figure, FigureCanvasAgg = _load_matplotlib(os.path.dirname(path) or ".")
    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_samples), (ax_factor, ax_lr) = fig.subplots(2, 2)
    ax_factor.sharex(ax_loss)
    ax_lr.sharex(ax_loss)
    steps = history.column("step")
    samples = cumulative(history.column("samples"))
    _draw_loss(ax_loss, ax_samples, history, steps, samples)
    if evals:
        _draw_validation(ax_loss, ax_samples, evals, dict(zip(steps, samples)))
    _draw_factor(ax_factor, history, steps, numbers["segments"])
    _draw_lr(ax_lr, history, steps)
    ax_loss.set_xlim(0, steps[-1])
    ax_samples.set_xlim(0, samples[-1])
    _draw_markers(history, numbers, steps, samples, ax_loss, ax_samples, ax_factor, ax_lr)
    ax_loss.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=100)


def _draw_loss(ax_loss, ax_samples, history: History, steps: list, samples: list) -> None:
    """The training loss per step against steps and against samples seen; skipped steps marked with an x.

    Skipped steps have no loss (NaN); the line joins their neighbours. A short run gets markers and no moving
    average (a window under 3 steps would only repeat the raw line).
    """
    # optional, loaded by _load_matplotlib above
    from matplotlib.ticker import EngFormatter

    loss = [float(v) for v in history.column("loss")]
    smooth = rolling_mean(loss, max(1, len(loss) // 40))
    skipped = [i for i, s in enumerate(history.steps) if s["skipped"]]
    finite = [v for v in loss if math.isfinite(v)]
    log_loss = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 20
    kept = [i for i, v in enumerate(loss) if math.isfinite(v)]
    short = len(loss) // 40 < 3
    for ax, xs, xlabel in ((ax_loss, steps, "optimizer step"), (ax_samples, samples, "samples seen (all ranks)")):
        ax.plot([xs[i] for i in kept], [loss[i] for i in kept], color="tab:blue", alpha=0.9 if short else 0.25,
                linewidth=1.2 if short else 0.8, marker="o" if len(loss) <= 100 else None, markersize=3,
                label="loss per step")
        if not short:
            ax.plot(xs, smooth, color="tab:blue", linewidth=1.8, label="moving average")
        if skipped:
            ax.plot([xs[i] for i in skipped], [0.02] * len(skipped), "x", color="tab:red", markersize=7,
                    transform=ax.get_xaxis_transform(), clip_on=False, label=f"skipped step ({len(skipped)})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (mean per element)")
        if log_loss:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    ax_loss.set_title("Loss against optimizer steps", fontsize=11)
    ax_samples.set_title("Loss against samples seen", fontsize=11)
    ax_samples.xaxis.set_major_formatter(EngFormatter(sep=""))


def _draw_validation(ax_loss, ax_samples, evals: list[dict], samples_at: dict) -> None:
    """The validation loss at each evaluation, on both loss panels (by step, and by the samples seen by then)."""
    points = [(e["step"], float(e["val_loss"])) for e in evals if math.isfinite(float(e["val_loss"]))]
    if not points:
        return
    style = dict(color="tab:red", linewidth=1.6, marker="s", markersize=4)
    ax_loss.plot([s for s, _ in points], [v for _, v in points], label="validation loss", **style)
    on_samples = [(samples_at[s], v) for s, v in points if s in samples_at]
    ax_samples.plot([x for x, _ in on_samples], [v for _, v in on_samples], label="validation loss", **style)
    ax_samples.legend(loc="upper right", fontsize=8)


def _draw_factor(ax, history: History, steps: list, segments: list) -> None:
    """The accumulation factor per window, each level labelled, and the effective batch as a second scale.

    The factor holds for a whole window: window k spans (k-1, k] in "steps completed", hence steps-pre from 0.
    """
    # optional, loaded by _load_matplotlib above
    from matplotlib.ticker import MaxNLocator

    factors = history.column("factor")
    ax.step([0] + steps, [factors[0]] + factors, where="pre", color="tab:green", linewidth=1.8)
    ax.set_ylabel("accumulation factor", color="tab:green")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(factors) * 1.15)
    ax.set_xlabel("optimizer step")
    ax.set_title("Accumulation factor and effective batch", fontsize=11)
    ax.grid(True, alpha=0.3)
    for seg in segments:  # label each level over its middle; the last one ends at the right edge
        text = f"×{seg.factor}" + (f" (batch {seg.effective_batch})" if seg.effective_batch else "")
        last = seg is segments[-1]
        x = seg.last_step if last else (seg.first_step - 1 + seg.last_step) / 2
        ax.annotate(text, (x, seg.factor), xytext=(-4 if last else 0, 4), textcoords="offset points",
                    fontsize=8, color="tab:green", ha="right" if last else "center")
    batches = history.column("effective_batch")
    ratios = {b / f for b, f in zip(batches, factors) if b is not None and f}
    if len(ratios) == 1:  # effective batch = factor x micro-batch x world: one line, a second scale
        ratio = ratios.pop()
        right = ax.secondary_yaxis("right", functions=(lambda f: f * ratio, lambda b: b / ratio))
        right.set_ylabel("effective batch (samples per step)")
    elif ratios:
        right = ax.twinx()
        right.step([0] + steps, [batches[0]] + batches, where="pre", color="tab:purple", linewidth=1.2)
        right.set_ylabel("effective batch", color="tab:purple")


def _draw_lr(ax, history: History, steps: list) -> None:
    ax.plot(steps, history.column("lr"), color="tab:orange", linewidth=1.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning rate", fontsize=11)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(True, alpha=0.3)


def _draw_markers(history: History, numbers: dict, steps: list, samples: list, ax_loss, ax_samples, ax_factor,
                  ax_lr) -> None:
    """Vertical lines on every panel: epoch starts (named on a top axis), factor changes, resumes.

    Factor changes appear on the other panels too: the point of the picture is what a change did to the loss.
    """
    bounds = epoch_boundaries(history)
    epochs = [b[0] for b in bounds]
    for ax in (ax_loss, ax_factor, ax_lr):
        _mark_epochs(ax, [b[1] for b in bounds], epochs, top_label=ax is ax_loss)
    _mark_epochs(ax_samples, [b[2] for b in bounds], epochs, top_label=True)
    changes = numbers["segments"][1:]
    index = {step: i for i, step in enumerate(steps)}
    for seg in changes:
        samples_before = samples[index[seg.first_step] - 1]
        for ax, x in ((ax_loss, seg.first_step - 1), (ax_lr, seg.first_step - 1), (ax_samples, samples_before)):
            ax.axvline(x, color="tab:green", linestyle="--", linewidth=0.9, alpha=0.8)
    if changes:
        ax_loss.plot([], [], color="tab:green", linestyle="--", linewidth=0.9, label="factor change")
    for step in history.resumed_at:
        samples_before = samples[index[step] - 1] if index[step] else 0
        for ax, x in ((ax_loss, step - 1), (ax_factor, step - 1), (ax_lr, step - 1), (ax_samples, samples_before)):
            ax.axvline(x, color="tab:purple", linestyle="--", linewidth=1.0)
    if history.resumed_at:
        ax_loss.plot([], [], color="tab:purple", linestyle="--", label="resumed from checkpoint")
