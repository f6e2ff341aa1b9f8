"""``logging.wandb`` and ``logging.mlflow``: their keys, defaults and the pre-launch check that the package is there.

Torch-free and import-free (`accum-sched check` runs on login nodes): the packages are only looked up with
``importlib.util.find_spec``; rank 0 imports them when it trains (launcher/train/trackers.py). See docs/trackers.md.
"""
from __future__ import annotations

import importlib.util
import os

from launcher.errors import ConfigError

WANDB_KEYS = ("project", "name", "tags", "mode", "entity", "dir")
WANDB_MODES = ("online", "offline", "disabled")
MLFLOW_KEYS = ("experiment", "run_name", "tags", "tracking_uri")
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # config key -> the module rank 0 imports


def _known(path: str, value, keys: tuple, example: str) -> None:
    """A mapping whose keys are all in ``keys`` (an unknown one is named with its full path)."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping or null, got {value!r}", f"write e.g. {example}")
    for k in value:
        if k not in keys:
            raise ConfigError(f"{path}.{k}", "unknown key", f"known keys: {', '.join(keys)}")


def _text(path: str, value, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {value!r}", "quote the value")


def _check_wandb(spec) -> None:
    field = "logging.wandb"
    _known(field, spec, WANDB_KEYS, "{project: my-project, mode: offline}")
    if "project" not in spec:
        raise ConfigError(f"{field}.project", "is required", "add project: <your wandb project>")
    for k in ("project", "name", "entity", "dir"):
        _text(f"{field}.{k}", spec.get(k), required=k == "project")
    mode = spec.get("mode", "online")
    if mode not in WANDB_MODES:
        raise ConfigError(f"{field}.mode", f"{mode!r} is not one of {', '.join(WANDB_MODES)}",
                          "offline writes the run under logging.wandb.dir for `wandb sync`")
    tags = spec.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        raise ConfigError(f"{field}.tags", f"expected a list of strings, got {tags!r}", "write e.g. [baseline]")


def _check_mlflow(spec) -> None:
    field = "logging.mlflow"
    _known(field, spec, MLFLOW_KEYS, "{experiment: my-experiment}")
    if "experiment" not in spec:
        raise ConfigError(f"{field}.experiment", "is required", "add experiment: <an MLflow experiment name>")
    _text(f"{field}.experiment", spec["experiment"], required=True)
    _text(f"{field}.run_name", spec.get("run_name"))
    _text(f"{field}.tracking_uri", spec.get("tracking_uri"))
    tags = spec.get("tags", {})
    ok = (isinstance(tags, dict) and all(isinstance(k, str) for k in tags)) or \
        (isinstance(tags, list) and all(isinstance(t, str) and t for t in tags))
    if not ok:
        raise ConfigError(f"{field}.tags", f"expected a mapping of strings or a list of strings, got {tags!r}",
                          "write e.g. {team: vision} or [baseline]")


def check(cfg) -> None:
    """Validation (launcher/config/schema.py): the keys of each configured tracker."""
    if cfg.logging.wandb is not None:
        _check_wandb(cfg.logging.wandb)
    if cfg.logging.mlflow is not None:
        _check_mlflow(cfg.logging.mlflow)


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
