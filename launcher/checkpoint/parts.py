"""The trainer's state a checkpoint holds, handed to the Checkpointer as a map of named stateful parts.

The Trainer builds the map (``Trainer.checkpoint_parts()``); the Checkpointer reads nothing else of the trainer.
Every part has ``state_dict()`` / ``load_state_dict()`` (an adapter below where the object has not), or is None
when the run has no such part:

==============  =============================================  ======================================
part            what                                           in ``trainer.pt`` under
==============  =============================================  ======================================
engine          the AccumulationEngine: position, counters      ``engine`` (its window per rank, in
                (also asked where a save happens)               ``window-rank<R>.pt``), ``last_step``
model           the module                                      ``model`` (\\*)
optimizer       the optimizer                                   ``optimizer`` (\\*)
scaler          the engine back end's GradScaler, or None       ``scaler`` (\\*)
lr_scheduler    the LR scheduler, or None                       ``lr_scheduler`` (also with DeepSpeed)
validation      best value and early-stop count, or None        ``eval``
sampler         the DistributedSampler's epoch (SamplerEpoch)   ``sampler_epoch``
stream          a stream's loader (launcher/train/streams.py),  ``stream-rank<R>.pt``: each rank's
                or None for a map-style dataset                 loader position, saved mid-epoch
backend         the launcher back end (launcher/backends/)      its own sharded files where it has them
setup           what the back end's setup built (its Setup)     (DeepSpeed: ``deepspeed/``, FSDP2: ``fsdp/``)
==============  =============================================  ======================================

(\\*) only when trainer.pt holds the model state: DeepSpeed and FSDP2 write sharded files of their own (the
Checkpointer's back-end spots decide).
"""
from __future__ import annotations

import os

import torch

from launcher.checkpoint import dcp_metadata, pickle_scan

PARTS = ("engine", "model", "optimizer", "scaler", "lr_scheduler", "validation", "sampler", "stream", "backend",
         "setup")


class SamplerEpoch:
    """A DistributedSampler as a stateful part: its state is the epoch it shuffles for (an int on disk)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def state_dict(self) -> int:
        return int(self.sampler.epoch)

    def load_state_dict(self, epoch) -> None:
        self.sampler.set_epoch(int(epoch))


def check_parts(parts: dict) -> dict:
    """``parts`` with every name of PARTS (absent ones None); a name not in PARTS is a programming error."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise TypeError(f"unknown checkpoint parts {unknown}; known: {', '.join(PARTS)}")
    if parts.get("engine") is None or parts.get("sampler") is None or parts.get("backend") is None:
        raise TypeError("checkpoint parts need an engine, a sampler and a back end")
    return {name: parts.get(name) for name in PARTS}


def _state_or_none(part):
    return None if part is None else part.state_dict()


def _model_in_trainer_pt(parts: dict) -> bool:
    """trainer.pt holds model, optimizer and scaler, unless the back end keeps a sharded checkpoint of its own
    (DeepSpeed's files under deepspeed/, FSDP2's DCP shards under fsdp/: launcher/backends/)."""
    return not parts["backend"].sharded_checkpoint


def save_shards(parts: dict, tmp: str) -> None:
    """Collective: every rank writes the back end's own shards under ``tmp`` (no-op when trainer.pt holds them)."""
    if not _model_in_trainer_pt(parts):
        parts["backend"].save_shards(parts["setup"], tmp)


def stage_shards(parts: dict, tmp: str, group):
    """checkpoint.async, collective: every rank copies its shards to host memory now and returns a callable that
    writes them under ``tmp`` (on ``group``, the background thread's), or None when trainer.pt holds the model."""
    if _model_in_trainer_pt(parts):
        return None
    return parts["backend"].stage_shards(parts["setup"], tmp, group)


def load_shards(parts: dict, path: str) -> None:
    """Collective: every rank loads its shards of checkpoint ``path`` (no-op when trainer.pt holds the model)."""
    if not _model_in_trainer_pt(parts):
        dcp_metadata.check_tree(path)  # DCP unpickles its .metadata without weights_only: checked first
        backend = parts["backend"]
        if backend.unpickled_files is not None:  # DeepSpeed's files, which it loads with weights_only=False
            pickle_scan.check_tree(os.path.join(path, backend.unpickled_files))
        backend.load_shards(parts["setup"], path)


def save_parts(parts: dict) -> dict:
    """The trainer.pt entries of every part but the engine (model, optimizer and scaler only where the back end
    writes no shards of its own)."""
    model_state = _model_in_trainer_pt(parts)
    entries = {"sampler_epoch": parts["sampler"].state_dict(), "lr_scheduler": _state_or_none(parts["lr_scheduler"])}
    if parts["validation"] is not None:  # best value and early-stop count (launcher/train/validation.py)
        entries["eval"] = parts["validation"].state_dict()
    if model_state:
        entries.update(model=parts["model"].state_dict(), optimizer=parts["optimizer"].state_dict(),
                       scaler=_state_or_none(parts["scaler"]))
    return entries


def load_model_parts(parts: dict, state: dict, lr_scheduler: bool = True) -> None:
    """Model and optimizer (when trainer.pt holds them), LR scheduler and GradScaler from trainer.pt's ``state``.
    ``lr_scheduler=False``: the scheduler starts afresh (force_resume with another LR scheduler configured)."""
    if _model_in_trainer_pt(parts):
        parts["model"].load_state_dict(state["model"])
        if "optimizer" in state:  # absent: force_resume with another optimizer, which starts afresh
            parts["optimizer"].load_state_dict(state["optimizer"])
            own_optimizer_state(parts["optimizer"])
    if lr_scheduler and parts["lr_scheduler"] is not None and state.get("lr_scheduler") is not None:
        parts["lr_scheduler"].load_state_dict(state["lr_scheduler"])  # also when DeepSpeed does not own it
    if parts["scaler"] is not None and state.get("scaler") is not None:
        parts["scaler"].load_state_dict(state["scaler"])


def load_data_parts(parts: dict, state: dict) -> None:
    """The sampler's epoch and the validation state (None for a checkpoint saved before evaluation existed)."""
    parts["sampler"].load_state_dict(state["sampler_epoch"])
    if parts["validation"] is not None:
        parts["validation"].load_state_dict(state.get("eval"))


def own_optimizer_state(optimizer) -> None:
    """Give the optimizer private copies of host tensors it took over from an mmap-loaded checkpoint.

    ``optimizer.load_state_dict`` keeps a loaded tensor as it is when dtype and device already match (CPU
    training), so its state would stay backed by trainer.pt's pages; a state entry that is never updated in place
    (a parameter without a gradient) would then read a file that rotation, maybe on another node, deletes. State
    moved to a GPU is a copy already."""
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                entry[key] = value.clone()
