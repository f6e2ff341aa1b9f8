"""Run outputs on rank 0: metrics.jsonl (one line per optimizer step), summary.json, progress, TensorBoard."""
from __future__ import annotations

import json
import os
import sys
import time


def atomic_write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A one-line bar on a TTY, plain log lines otherwise (every ``log_every`` steps and at each epoch end)."""

    def __init__(self, mode: str, epochs: int, total_steps: int, log_every: int, stream=None):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode, self.epochs, self.total, self.log_every = mode, epochs, total_steps, log_every
        self._drawn = 0.0  # when the bar was last drawn (time.monotonic)

    def step(self, info, effective_batch) -> None:
        if self.mode == "none":
            return
        of = f"/{self.total}" if self.total else ""  # no total: a stream without run.max_steps
        text = (f"epoch {info.epoch} of 0-{self.epochs - 1}  step {info.step}{of}  loss {info.loss:.4f}  "
                f"factor {info.factor}  eff.batch {effective_batch}  lr {info.lr:.3g}")
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


class MetricsWriter:
    """Appends one JSON line per optimizer step; mirrors scalars to TensorBoard when it is installed and wanted."""

    def __init__(self, run_dir: str, tensorboard: str = "auto", start_time: float | None = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.start = time.time() if start_time is None else start_time
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard == "on":
                    raise RuntimeError("logging.tensorboard: on needs the tensorboard package; "
                                       "pip install tensorboard") from None
            else:
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def write(self, info, effective_batch: int | None) -> None:
        record = info.to_dict()
        record["effective_batch"] = effective_batch
        record["wall_time"] = round(time.time() - self.start, 4)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "factor"):
                if record[key] is not None:  # grad_norm is measured at the logging cadence only
                    self._tb.add_scalar(f"train/{key}", record[key], info.step)
            if record.get("noise_scale") is not None:  # accumulation.noise_scale
                self._tb.add_scalar("train/noise_scale", record["noise_scale"], info.step)

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
