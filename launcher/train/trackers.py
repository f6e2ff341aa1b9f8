"""Experiment trackers on rank 0: Weights & Biases (``logging.wandb``) and MLflow (``logging.mlflow``).

Only rank 0 builds a :class:`Trackers` (the trainer's _open_outputs), so no other rank ever imports wandb or mlflow.
Each tracker gets the resolved config once, every metrics.jsonl record at its step (numeric fields under ``train/``),
every evaluation under ``val/`` and the summary at the end. The tracker runs' ids are kept in
``<run.output_dir>/trackers.json`` so that ``accum-sched run --resume`` continues the same tracker runs; the steps a
resume trains again (those after its checkpoint that the tracker already has) are not logged twice: the file also
holds the last step each stream was logged at, rewritten after every step. See docs/trackers.md.
"""
from __future__ import annotations

import json
import math
import os
import time

from launcher.config import trackers as settings
from launcher.config.schema import key_paths
from launcher.train.metrics import atomic_write_json

STATE_FILE = "trackers.json"
PARAM_LIMIT = 6000  # MLflow's longest param value
PARAMS_PER_BATCH = 100  # MLflow's log_batch limit


def numeric(record: dict, prefix: str, skip=("step",)) -> dict:
    """``{prefix/key: value}`` of the record's finite numbers (bools and nulls left out): what trackers plot."""
    return {f"{prefix}/{k}": float(v) for k, v in record.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flat_params(config: dict) -> dict[str, str]:
    """The resolved config as MLflow params: ``section.key`` (``distributed.fsdp.param_dtype`` inside the nested
    section) -> its value as JSON text, cut to MLflow's limit. A null section (``lr_scheduler: null``) is one param."""
    out = {}
    for path in key_paths():
        value, found = config, True
        for part in path.split("."):
            if not isinstance(value, dict):
                found = False
                break
            value = value.get(part)
        if not found:  # inside a section written as null
            out[path.split(".")[0]] = "null"
            continue
        out[path] = (value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str))[:PARAM_LIMIT]
    return out


class _Wandb:
    def __init__(self, cfg, config: dict, run_id: str | None):
        # optional, and only with logging.wandb
        import wandb

        s = settings.wandb_settings(cfg)
        os.makedirs(s["dir"], exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}  # a new run: wandb picks the id
        self.run = wandb.init(project=s["project"], name=s["name"], tags=s["tags"], mode=s["mode"],
                              entity=s["entity"], dir=s["dir"], **resume)
        self.run.config.update(config, allow_val_change=True)  # on a resume: the config it resumed under
        self.id = self.run.id

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def summary(self, summary: dict) -> None:
        self.run.summary.update(summary)

    def close(self, preempted: bool) -> None:
        if preempted:
            self.run.mark_preempting()
        self.run.finish()


class _Mlflow:
    def __init__(self, cfg, config: dict, run_id: str | None):
        s = settings.mlflow_settings(cfg)
        if settings.is_file_store(s["tracking_uri"]):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store otherwise
        # optional, and only with logging.mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=s["tracking_uri"])
        if run_id:
            client.update_run(run_id, status="RUNNING")
            have = client.get_run(run_id).data.params
        else:
            experiment = client.get_experiment_by_name(s["experiment"])
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(s["experiment"])
            run_id = client.create_run(experiment_id, run_name=s["run_name"], tags=s["tags"]).info.run_id
            have = {}
        self.id = run_id
        # params cannot change once logged: a resume adds the keys the run lacks and keeps the first values
        params = [Param(k, v) for k, v in flat_params(config).items() if k not in have]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log(self, values: dict, step: int) -> None:
        # optional, and only with logging.mlflow
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def summary(self, summary: dict) -> None:
        self.client.log_dict(self.id, summary, "summary.json")
        self.log(numeric(summary, "summary", skip=()), summary.get("optimizer_steps") or 0)

    def close(self, preempted: bool) -> None:
        self.client.set_terminated(self.id, "KILLED" if preempted else "FINISHED")


class Trackers:
    """The configured trackers of one run (rank 0), with the last step each has of ``train/`` and ``val/``."""

    KINDS = {"wandb": _Wandb, "mlflow": _Mlflow}

    def __init__(self, cfg, run_dir: str, resumed: bool):
        self.path = os.path.join(run_dir, STATE_FILE)
        saved = self._read() if resumed else {}
        config = cfg.to_dict()
        self.open = {name: self.KINDS[name](cfg, config, saved.get(name)) for name in settings.configured(cfg)}
        self.last = {"step": saved.get("step", 0), "eval_step": saved.get("eval_step", -1)}
        self._save()

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def _save(self) -> None:
        atomic_write_json(self.path, {**{name: t.id for name, t in self.open.items()}, **self.last})

    def _log(self, record: dict, prefix: str, mark: str) -> None:
        step = int(record["step"])
        if step <= self.last[mark]:  # a resume trains these steps again; the tracker has them already
            return
        values = numeric(record, prefix)
        for tracker in self.open.values():
            tracker.log(values, step)
        self.last[mark] = step
        self._save()

    def log_step(self, record: dict) -> None:
        """One metrics.jsonl record (its numeric fields under ``train/``) at its optimizer step."""
        self._log(record, "train", "step")

    def log_eval(self, record: dict) -> None:
        """One evaluation (an eval.jsonl record) under ``val/`` at the step it ran after."""
        self._log(record, "val", "eval_step")

    def finish(self, summary: dict) -> None:
        """The run's summary.json, then close every tracker run as finished."""
        for tracker in self.open.values():
            tracker.summary(summary)
        self.close()

    def close(self, preempted: bool = False) -> None:
        for tracker in self.open.values():
            tracker.close(preempted)


def start(cfg, run_dir: str, resumed: bool) -> Trackers | None:
    """Rank 0's trackers, or None when the config names none (then wandb and mlflow are never imported)."""
    if not settings.configured(cfg):
        return None
    return Trackers(cfg, run_dir, resumed)
