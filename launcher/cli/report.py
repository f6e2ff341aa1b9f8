"""`accum-sched report RUN_DIR`: RUN_DIR/report.png (matplotlib) and a text summary (stdout and RUN_DIR/report.txt).

Reads only JSON (metrics.jsonl, summary.json): no torch, so it runs anywhere the run directory is, e.g. a laptop.
"""
from __future__ import annotations

import json
import os
import sys

from launcher.errors import ConfigError
from launcher.report import noise as report_noise
from launcher.report import render as report


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="plot a run's loss (and validation loss), schedule and LR to RUN_DIR/report.png "
                                           "and summarise it")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory (run.output_dir)")
    p.set_defaults(func=main)


def read_evals(run_dir: str) -> list[dict]:
    """eval.jsonl's records ([] when the run did not evaluate)."""
    path = os.path.join(run_dir, "eval.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return report.parse_evals(f, where=f"{run_dir}: eval.jsonl")


def read_inputs(run_dir: str) -> tuple[report.History, dict | None]:
    """The parsed metrics and summary.json (None when absent); ConfigError for anything the report cannot use."""
    if not os.path.isdir(run_dir):
        raise ConfigError(run_dir, "no such run directory",
                          "give the output_dir of a run (run.output_dir in its config)")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ConfigError(run_dir, "has no metrics.jsonl",
                          "give the output_dir of a run started with accum-sched run, after its first optimizer step")
    with open(metrics, encoding="utf-8") as f:
        history = report.parse_metrics(f, where=f"{run_dir}: metrics.jsonl")
    if not history.steps:
        raise ConfigError(run_dir, "metrics.jsonl is empty (no optimizer step was logged)",
                          "report after the run has taken at least one optimizer step")
    summary = None
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                summary = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(run_dir, f"summary.json is not valid JSON ({exc})",
                              "delete it to report from metrics.jsonl alone") from None
        if not isinstance(summary, dict):
            raise ConfigError(run_dir, "summary.json is not a JSON object",
                              "delete it to report from metrics.jsonl alone")
    return history, summary


def main(args) -> int:
    run_dir = args.run_dir
    report._load_matplotlib(run_dir)  # fail before any work when the extra is missing
    history, summary = read_inputs(run_dir)
    evals = read_evals(run_dir)
    numbers = report.summarize(history, summary, evals)
    for note in report.gap_warnings(numbers):  # steps missing from metrics.jsonl: said apart from the summary too
        print(f"warning: {run_dir}: {note}", file=sys.stderr, flush=True)
    text = report.format_summary(numbers, run_dir)
    png = os.path.join(run_dir, "report.png")
    report.render(history, numbers, png, report.title(numbers, run_dir), evals)
    pictures = f"picture           {png}"
    if report_noise.has_noise(history):  # accumulation.noise_scale / adaptive: B_noise next to the batch
        text += report_noise.summary_line(history)
        noise_png = os.path.join(run_dir, "noise_scale.png")
        report_noise.render_noise(history, noise_png, report.title(numbers, run_dir))
        pictures += f"\nnoise scale plot  {noise_png}"
    with open(os.path.join(run_dir, "report.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text + pictures, flush=True)
    return 0
