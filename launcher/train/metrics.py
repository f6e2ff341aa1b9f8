"""Run outputs on rank 0: metrics.jsonl (one line per optimizer step), summary.json, progress, TensorBoard."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable

from accum_sched.position import Position

SPEED_FIELDS = ("samples_per_s", "tokens_per_s", "elapsed_s")  # on every metrics.jsonl line (tokens: null if none)


def atomic_write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded): an ETA of days still reads at a glance."""
    total = max(0, round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def format_rate(value: float) -> str:
    """1234 -> ``1.2k``, 2.5e6 -> ``2.5M``, 87.25 -> ``87.2``: short enough for a one-line bar."""
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.3g}"


def report_line(run_dir: str, matplotlib: bool | None = None) -> str:
    """A run's last line: the command that shows its report, and first what to install where the report cannot
    run (it draws with matplotlib, the `report` extra, which the base install leaves out for training nodes)."""
    if matplotlib is None:
        matplotlib = importlib.util.find_spec("matplotlib") is not None
    command = f"accum-sched report {shlex.quote(run_dir)}"
    if matplotlib:
        return f"accum-sched: see the report: {command}"
    return f"accum-sched: see the report: pip install 'accum-sched[report]' (matplotlib), then {command}"


def planned_micro_batches(window_sizes: Iterable[int], max_steps: int | None) -> int:
    """Micro-batches per rank of a run whose windows (micro-batches per optimizer step, in order) are
    ``window_sizes``, cut at ``max_steps`` steps: what the ETA counts down, since a step's cost is its factor."""
    total = 0
    for step, size in enumerate(window_sizes):
        if max_steps is not None and step >= max_steps:
            break
        total += size
    return total


def steps_after_resume(schedule, batches: int, epochs: int, epoch: int, index: int, step: int,
                       counted_step: int) -> int:
    """A resumed run's own optimizer-step total: the ``step`` steps it resumed after, plus the windows an epoch- or
    step-keyed ``schedule`` forms from micro-batch ``index`` of ``epoch`` on (``counted_step``: the step the schedule
    sees, fp16 overflow steps left out). Planning from epoch 0 replays the resumed schedule over the history instead,
    which differs from it under checkpoint.force_resume (an `accum-sched cbs` branch): its total fell below the step
    the run resumed at."""
    steps = 0
    while epoch < epochs:
        while index < batches:
            index += min(schedule.factor_for(Position(epoch=epoch, step=counted_step + steps)), batches - index)
            steps += 1
        epoch, index = epoch + 1, 0
    return step + steps


def stream_remaining_micro_batches(milestones: Iterable[tuple[int, int]], steps_done: int, max_steps: int) -> int:
    """A stream's micro-batches per rank still to run: the sum of the scheduled factors of the steps left before
    ``run.max_steps``, for factors keyed by step (``((first_step, factor), ...)``, factor 1 before the first key;
    a stream has no length, so its windows are full). Closed form per milestone: cheap at every step."""
    keys = sorted(milestones)
    total = 0
    for i, (first, factor) in enumerate([(0, 1)] + keys):
        end = keys[i][0] if i < len(keys) else max_steps  # this factor holds from `first` until the next key
        lo, hi = max(first, steps_done), min(end, max_steps)
        if hi > lo:
            total += (hi - lo) * factor
    return total


def eta_seconds(remaining_micro_batches: int | None, seconds_per_micro_batch: float | None) -> float | None:
    """Time left: the remaining micro-batches at the recent pace per micro-batch (None: not known)."""
    if remaining_micro_batches is None or seconds_per_micro_batch is None:
        return None
    return max(0, remaining_micro_batches) * seconds_per_micro_batch


class Throughput:
    """Samples/s, tokens/s and seconds per micro-batch over the last ``window`` optimizer steps, and the elapsed
    training time (``elapsed_before``: what a resumed run had trained already, so elapsed_s continues)."""

    def __init__(self, window: int, tokens: bool, elapsed_before: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.tokens, self.elapsed_before, self.clock = tokens, elapsed_before, clock
        self.began = clock()
        # (time, samples, tokens, micro-batches) of the last `window` steps, after the mark the window starts at
        self._marks: deque = deque([(self.began, 0, 0, 0, 0.0)], maxlen=max(1, window) + 1)

    def add(self, info, now: float | None = None, paused: float = 0.0) -> dict:
        """Count one optimizer step; the speed fields of its metrics line plus ``seconds_per_micro_batch``.
        ``paused``: seconds so far that were no training (run.compile's compilations, a running total): the
        pace per micro-batch, which the ETA multiplies by what is left, leaves them out; the rates keep them."""
        now = self.clock() if now is None else now
        self._marks.append((now, info.samples, info.elements if self.tokens else 0, info.micro_batches, paused))
        steps = list(self._marks)[1:]
        seconds = max(now - self._marks[0][0], 1e-9)  # one clock tick: never a division by zero
        training = max(seconds - (paused - self._marks[0][4]), 1e-9)
        micro = sum(m[3] for m in steps)
        return {"samples_per_s": round(sum(m[1] for m in steps) / seconds, 3),
                "tokens_per_s": round(sum(m[2] for m in steps) / seconds, 3) if self.tokens else None,
                "elapsed_s": round(self.elapsed_before + now - self.began, 4),
                "seconds_per_micro_batch": training / micro if micro else None}

    def elapsed(self) -> float:
        return self.elapsed_before + self.clock() - self.began


def epoch_seconds(records: list[dict], completed_epochs: int) -> list[float]:
    """Wall-clock of each completed epoch from metrics.jsonl's elapsed_s: from the previous epoch's last step to
    this epoch's last one (a resumed run's earlier epochs included, as elapsed_s continues across resumes)."""
    last: dict[int, float] = {}
    for record in records:
        if record.get("elapsed_s") is not None:
            last[record["epoch"]] = max(last.get(record["epoch"], 0.0), record["elapsed_s"])
    out, before = [], 0.0
    for epoch in range(completed_epochs):
        end = last.get(epoch, before)
        out.append(round(end - before, 3))
        before = end
    return out


class Progress:
    """A one-line bar on a TTY, plain log lines otherwise (every ``log_every`` steps and at each epoch end)."""

    def __init__(self, mode: str, epochs: int, total_steps: int, log_every: int, stream=None):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode, self.epochs, self.total, self.log_every = mode, epochs, total_steps, log_every
        self._drawn = 0.0  # when the bar was last drawn (time.monotonic)

    def step(self, info, effective_batch, speed: dict | None = None, eta: float | None = None) -> None:
        """``speed``: Throughput.add's fields; ``eta``: seconds left (eta_seconds), None where not known."""
        if self.mode == "none":
            return
        of = f"/{self.total}" if self.total else ""  # no total: a stream without run.max_steps
        text = (f"epoch {info.epoch} of 0-{self.epochs - 1}  step {info.step}{of}  loss {info.loss:.4f}  "
                f"factor {info.factor}  eff.batch {effective_batch}  lr {info.lr:.3g}")
        if speed is not None:
            text += f"  {format_rate(speed['samples_per_s'])} samples/s"
            if speed.get("tokens_per_s") is not None:
                text += f"  {format_rate(speed['tokens_per_s'])} tok/s"
            text += f"  elapsed {format_duration(speed['elapsed_s'])}"
            text += f"  ETA {format_duration(eta) if eta is not None else '-'}"
        if self.mode == "bar":
            now = time.monotonic()
            if now - self._drawn < 0.1 and info.step != self.total:
                return  # at most ten redraws a second: fast steps would spend their time on the terminal
            self._drawn = now
            done = min(30, int(30 * info.step / self.total)) if self.total else 0
            self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {text}\x1b[K")
            self.stream.flush()
        elif info.step % self.log_every == 0 or info.step == self.total:
            print(text, file=self.stream, flush=True)

    def epoch_end(self, epoch: int, loss: float, seconds: float) -> None:
        if self.mode == "none":
            return
        line = f"epoch {epoch} of 0-{self.epochs - 1} done  loss {loss:.4f}  {seconds:.1f}s"
        if self.mode == "bar":
            self.stream.write("\r" + line + "\x1b[K\n")
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)


    def evaluation(self, record: dict, best: dict | None, monitor: str) -> None:
        """One line per evaluation (on its own line in bar mode too): the monitored value and the best so far."""
        if self.mode == "none":
            return
        extra = "".join(f"  {k} {v:.4g}" for k, v in record.items()
                        if k not in ("epoch", "step", "val_loss", "val_elements", "wall_time"))
        line = (f"eval  epoch {record['epoch']}  step {record['step']}  val_loss {record['val_loss']:.4f}{extra}  "
                f"({record['val_elements']} elements)")
        if best is not None:
            line += f"  best {monitor} {best[monitor]:.4f} at step {best['step']}"
        if self.mode == "bar":
            self.stream.write("\r" + line + "\x1b[K\n")
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)


def last_elapsed(path: str) -> float:
    """elapsed_s of metrics.jsonl's last line (0.0 without one: a fresh run, or lines older than the field)."""
    if not os.path.exists(path):
        return 0.0
    try:
        records = read_jsonl(path)
    except ValueError:  # a torn last line: a resume cuts it away first, so only a foreign file gets here
        return 0.0
    return float(records[-1].get("elapsed_s") or 0.0) if records else 0.0


class MetricsWriter:
    """Appends one JSON line per optimizer step; mirrors scalars to TensorBoard when it is installed and wanted."""

    def __init__(self, run_dir: str, tensorboard: str = "auto", start_time: float | None = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.start = time.time() if start_time is None else start_time
        # a resume cut the file back to its checkpoint already: its last line is where training time stands
        self.elapsed_before = last_elapsed(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard != "off":
            try:
                # optional (tensorboard): only logging.tensorboard needs it
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard == "on":
                    raise RuntimeError("logging.tensorboard: on needs the tensorboard package; "
                                       "pip install tensorboard") from None
            else:
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def write(self, info, effective_batch: int | None, speed: dict | None = None) -> dict:
        """Append the step's line (``speed``: Throughput.add's fields, SPEED_FIELDS of them kept); returns it, for
        the experiment trackers."""
        record = info.to_dict()
        record["effective_batch"] = effective_batch
        record["wall_time"] = round(time.time() - self.start, 4)
        if speed is not None:
            record.update({key: speed[key] for key in SPEED_FIELDS})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "factor"):
                if record[key] is not None:  # grad_norm is measured at the logging cadence only
                    self._tb.add_scalar(f"train/{key}", record[key], info.step)
            if record.get("noise_scale") is not None:  # accumulation.noise_scale
                self._tb.add_scalar("train/noise_scale", record["noise_scale"], info.step)
            for key in ("samples_per_s", "tokens_per_s"):
                if record.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], info.step)
        return record

    def write_eval(self, record: dict) -> None:
        """Mirror an evaluation (an eval.jsonl line, written by launcher/train/validation.py) to TensorBoard."""
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("epoch", "step", "wall_time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"val/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
