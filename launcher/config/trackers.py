"""``logging.wandb`` and ``logging.mlflow``: their keys, defaults and the pre-launch check that the package is there.

Torch-free and import-free (`accum-sched check` runs on login nodes): the packages are only looked up with
``importlib.util.find_spec``; rank 0 imports them when it trains (launcher/train/trackers.py). See docs/trackers.md.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Annotated, Any, Literal

from pydantic import StringConstraints

from launcher.errors import ConfigError
from launcher.options import options

WANDB_MODES = ("online", "offline", "disabled")
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # config key -> the module rank 0 imports


NonEmpty = Annotated[str, StringConstraints(min_length=1)]


@options
class WandbOptions:
    """``logging.wandb``: rank 0 logs to Weights & Biases (``project`` required)."""

    project: NonEmpty
    name: NonEmpty | None = None
    tags: list[NonEmpty] = dataclasses.field(default_factory=list)
    mode: Literal[WANDB_MODES] = "online"  # offline writes the run under logging.wandb.dir for `wandb sync`
    entity: NonEmpty | None = None
    dir: NonEmpty | None = None


@options
class MLflowOptions:
    """``logging.mlflow``: rank 0 logs to MLflow (``experiment`` required)."""

    experiment: NonEmpty
    run_name: NonEmpty | None = None
    tags: dict[str, Any] | list[NonEmpty] = dataclasses.field(default_factory=dict)
    tracking_uri: NonEmpty | None = None


def configured(cfg) -> list[str]:
    """The trackers the config names: a subset of ``["wandb", "mlflow"]`` (wandb's ``mode: disabled`` is none)."""
    wandb = cfg.logging.wandb
    return [name for name in PACKAGES if cfg.logging[name] is not None
            and not (name == "wandb" and wandb.get("mode") == "disabled")]


def preflight(cfg, find_spec=importlib.util.find_spec) -> None:
    """Before any worker starts: a configured tracker whose package cannot be imported is a config error (exit 2)
    rather than rank 0 failing after the process group is up. Looked up only, never imported."""
    for name in configured(cfg):
        if find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"logging.{name}", f"is set but the {name} package is not installed",
                              f"pip install 'accum-sched[{name}]', or set logging.{name}: null")


def wandb_settings(cfg) -> dict:
    """``logging.wandb`` with its defaults: name = the run directory's name, dir = the run directory."""
    spec, run_dir = cfg.logging.wandb, cfg.run.output_dir
    return {"project": spec["project"], "name": spec.get("name") or os.path.basename(os.path.abspath(run_dir)),
            "tags": list(spec.get("tags", [])), "mode": spec.get("mode", "online"), "entity": spec.get("entity"),
            "dir": spec.get("dir") or run_dir}


def mlflow_settings(cfg) -> dict:
    """``logging.mlflow`` with its defaults: run_name = the run directory's name, tracking_uri = a file store in
    ``<run.output_dir>/mlruns``; tags as a mapping (a list's entries become ``tag: "true"``)."""
    spec, run_dir = cfg.logging.mlflow, cfg.run.output_dir
    tags = spec.get("tags", {})
    tags = {t: "true" for t in tags} if isinstance(tags, list) else {k: str(v) for k, v in tags.items()}
    uri = spec.get("tracking_uri") or "file:" + os.path.join(os.path.abspath(run_dir), "mlruns")
    return {"experiment": spec["experiment"], "tags": tags, "tracking_uri": uri,
            "run_name": spec.get("run_name") or os.path.basename(os.path.abspath(run_dir))}


def is_file_store(uri: str) -> bool:
    """A local path or ``file:`` URI: MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true."""
    return uri.startswith("file:") or ("://" not in uri and not uri.startswith("databricks"))
