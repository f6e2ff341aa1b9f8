"""`accum-sched report` on a real run directory made here by `accum-sched run` (2 workers, a schedule change every
epoch, one NaN sample so that some steps are skipped): the PNG, the text summary against summary.json, no torch
import, resumed and rerun metrics, and the one-line errors."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import pytest

import paths
from launcher import cli
from launcher.report import render as report

ROOT = paths.ROOT

# A user task: the built-in regression with one NaN input, so every epoch has exactly one window whose loss is not
# finite and which the engine skips (accumulation.nonfinite: skip). shuffle: false keeps it in one known window.
NAN_TASK = """\
from launcher.tasks.builtin import regression


def task(samples=192, bad=70):
    made = regression(samples=samples)
    made["dataset"].tensors[0][bad] = float("nan")
    return made
"""

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: nan_task:task, args: {{}}}}
data: {{micro_batch_size: 16, shuffle: false}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 4}}, nonfinite: skip}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 2}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""

# Run outside pytest's process, so that nothing pytest or the other tests imported hides a torch import.
REPORT_WITHOUT_TORCH = """\
import sys
from launcher.cli import main
rc = main(["report", sys.argv[1]])
assert "torch" not in sys.modules, "accum-sched report imported torch"
sys.exit(rc)
"""

NO_MATPLOTLIB = """\
import sys
sys.modules["matplotlib"] = None  # what an environment without the package looks like to `import matplotlib`
from launcher.cli import main
sys.exit(main(["report", sys.argv[1]]))
"""


def python(code, *args, cwd=ROOT, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "nan_task.py").write_text(NAN_TASK)
    (tmp / "cfg.yaml").write_text(CONFIG.format(out=tmp / "run"))
    proc = python(None, "-m", "launcher", "run", "cfg.yaml", cwd=tmp)  # cwd: where nan_task.py is importable
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return str(tmp / "run")


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", head[16:24])


def field(text, label):
    match = re.search(rf"^{label}\s+(.*)$", text, re.M)
    assert match, f"no {label!r} line in:\n{text}"
    return match.group(1)


def test_report_of_a_real_run(run_dir):
    proc = python(REPORT_WITHOUT_TORCH, run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "report.txt")) as f:
        text = f.read()
    assert proc.stdout.startswith(text)

    png = os.path.join(run_dir, "report.png")
    width, height = png_size(png)
    assert (width, height) == (1300, 850)
    assert os.path.getsize(png) > 40_000  # four drawn panels, not a blank canvas

    # 96 samples per rank = 6 micro-batches; factors 1, 2, 4 -> 6 + 3 + 2 steps; the NaN sample spoils one per epoch.
    assert summary["optimizer_steps"] == 11 and summary["skipped_steps"] == 3
    assert field(text, "world size") == f"{summary['world_size']} (ddp)"
    assert field(text, "optimizer steps") == f"{summary['optimizer_steps']} ({summary['skipped_steps']} skipped)"
    assert field(text, "epochs") == f"{summary['completed_epochs']} of {summary['epochs']}"
    assert int(field(text, "samples seen")) == summary["samples"] == 192 * 3
    assert float(field(text, "final loss").split()[0]) == pytest.approx(summary["final_loss"], rel=1e-5)
    wall = re.fullmatch(r"([\d.]+) s \(training ([\d.]+) s, (\d+) samples/s\)", field(text, "wall time"))
    assert wall and float(wall.group(1)) == pytest.approx(summary["wall_seconds"], abs=0.05)
    training = metrics[-1]["wall_time"]
    assert float(wall.group(2)) == pytest.approx(training, abs=0.05)
    assert int(wall.group(3)) == pytest.approx(summary["samples"] / training, abs=1)
    rounds = summary["allreduce_rounds"]
    assert field(text, "all-reduce rounds") == f"{rounds}, {rounds / summary['optimizer_steps']:.2f} per optimizer step"
    rows = re.findall(r"^\s+(\S+)\s+(\d+-\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", text, re.M)
    assert rows == [("0", "1-6", "1", "32", "6"), ("1", "7-9", "2", "64", "3"), ("2", "10-11", "4", "128", "2")]
    assert "note:" not in text


@pytest.mark.slow
def test_resumed_rerun_and_torn_metrics(run_dir, tmp_path):
    """Real metrics lines rearranged the way the worker appends them: a resume from step 5 (newer lines win, wall
    time restarts), a fresh rerun into the same directory, and a last line cut short by a kill."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    resumed = []
    for line in lines[4:]:
        rec = json.loads(line)
        rec["resumed"] = True  # mark the resumed session's lines
        rec["wall_time"] -= json.loads(lines[3])["wall_time"]
        resumed.append(json.dumps(rec))
    history = report.parse_metrics(lines[:9] + resumed)
    assert [r["step"] for r in history.steps] == list(range(1, 12))
    assert [r.get("resumed", False) for r in history.steps] == [False] * 4 + [True] * 7
    assert history.resumed_at == [5] and len(history.sessions) == 2
    numbers = report.summarize(history, summary)
    assert numbers["samples"] == summary["samples"] and numbers["skipped"] == summary["skipped_steps"]
    first_session, second_session = json.loads(lines[8])["wall_time"], json.loads(resumed[-1])["wall_time"]
    assert numbers["train_seconds"] == pytest.approx(first_session + second_session)
    # the run's wall time: summary.json's session and the earlier one, never below the training time (issue 37.12)
    assert numbers["wall_seconds"] == pytest.approx(summary["wall_seconds"] + first_session)
    assert numbers["wall_seconds"] >= numbers["train_seconds"]
    text = report.format_summary(numbers, run_dir)
    assert field(text, "resumed at step") == "5"
    assert field(text, "wall time").startswith(f"{numbers['wall_seconds']:.1f} s over 2 sessions (training ")
    # stopped inside epoch 2 (run.max_steps, an early stop): the line names the epochs its steps are in, as the
    # picture does, next to the completed ones
    inside = report.format_summary(report.summarize(history, dict(summary, completed_epochs=2)), run_dir)
    assert field(inside, "epochs") == f"2 of {summary['epochs']} completed; steps in epochs 0-2"
    png = str(tmp_path / "resumed.png")
    report.render(history, numbers, png, report.title(numbers, run_dir))
    assert png_size(png) == (1300, 850)

    rerun = report.parse_metrics(lines + lines[:3] + ['{"epoch": 0, "step": 4, "fac'])
    assert [r["step"] for r in rerun.steps] == [1, 2, 3] and rerun.dropped_runs == 1 and rerun.torn_last_line
    notes = report.summarize(rerun, summary)["notes"]
    assert len(notes) == 3 and "earlier run" in notes[0] and "unfinished" in notes[1] and "another run" in notes[2]


def error_line(capsys, *argv):
    assert cli.main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    return err.strip()


def test_errors(tmp_path, capsys, run_dir):
    missing = str(tmp_path / "nope")
    assert error_line(capsys, "report", missing) == (
        f"error: {missing}: no such run directory; give the output_dir of a run (run.output_dir in its config)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no metrics.jsonl; " in error_line(capsys, "report", str(empty))
    (empty / "metrics.jsonl").write_text("\n")
    assert "metrics.jsonl is empty" in error_line(capsys, "report", str(empty))
    (empty / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert "line 1 lacks epoch, factor, samples, loss, lr, skipped; " in error_line(capsys, "report", str(empty))
    (empty / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    assert "line 1 is not JSON" in error_line(capsys, "report", str(empty))
    assert not (empty / "report.png").exists()

    proc = python(NO_MATPLOTLIB, run_dir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: {run_dir}: the report needs matplotlib, which is not installed; "
                           "pip install 'accum-sched[report]' (or pip install matplotlib)\n")
