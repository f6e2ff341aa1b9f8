"""DeepSpeed loads its own shards with torch.load(weights_only=False) (issue 28, item 5): before the DeepSpeed back end
hands a checkpoint to it, every file's pickles are read opcode by opcode, unpickled by nobody, and an import outside
the allow-list stops the resume with one line naming the file (launcher/checkpoint/pickle_scan.py).

A crafted shard whose unpickling would create a marker directory (it does under a plain torch.load) is placed in a
real ZeRO-2 checkpoint, its manifest rewritten to match (as whoever could write the file could): the resume exits
with that line on every rank, and the marker never appears. The files of real DeepSpeed checkpoints pass."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

import paths
from launcher.checkpoint import pickle_scan
from launcher.checkpoint.pickle_scan import UnsafePickle

TESTS = paths.TESTS
ROOT = paths.ROOT
needs_ds = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                              reason="deepspeed is not installed (pip install -e .[deepspeed])")
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: builtin:regression, args: {{samples: 64}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 2}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: deepspeed, nproc_per_node: 2, deepspeed_config: {{zero_optimization: {{stage: {stage}}}}}}}
checkpoint: {{every_n_steps: 2, keep_last: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""


class Payload:
    """Unpickling it calls os.makedirs(marker): what any code in a checkpoint could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def _accum(tmp, *extra, stage: int = 2):
    config = os.path.join(tmp, "ds.yaml")
    with open(config, "w") as f:
        f.write(CONFIG.format(out=os.path.join(tmp, "run"), stage=stage))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "launcher", "run", config, *extra], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=400)


def _trained(tmp_path_factory, stage: int):
    tmp = str(tmp_path_factory.mktemp(f"ds-scan-{stage}"))
    done = _accum(tmp, stage=stage)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    root = os.path.join(tmp, "run", "checkpoints")
    return tmp, os.path.join(root, sorted(n for n in os.listdir(root) if n.startswith("step-"))[-1])


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    return _trained(tmp_path_factory, 2)


@needs_ds
@pytest.mark.slow
def test_real_deepspeed_checkpoints_pass(ds_run, tmp_path_factory):
    _, ckpt = ds_run
    assert pickle_scan.check_tree(os.path.join(ckpt, "deepspeed")) == 3  # model states + 2 ZeRO-2 optimizer shards
    _, ckpt = _trained(tmp_path_factory, 3)  # ZeRO-3's optimizer shards name torch.Tensor as well
    assert pickle_scan.check_tree(os.path.join(ckpt, "deepspeed")) == 4  # per rank: model and optimizer shards


@needs_ds
@pytest.mark.slow
def test_malicious_shard_is_refused_and_never_runs(ds_run, tmp_path):
    tmp, ckpt = ds_run
    marker = str(tmp_path / "marker")
    shard = os.path.join(ckpt, "deepspeed", "mp_rank_00_model_states.pt")
    torch.save({"module": Payload(marker)}, shard)
    # the payload is live: a plain torch.load, as DeepSpeed's, runs it
    probe = f"import torch; torch.load({shard!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", probe], cwd=TESTS, check=True, timeout=120)
    assert os.path.isdir(marker)
    os.rmdir(marker)
    # whoever could write the shard could rewrite the manifest: its checksums then pass
    manifest_path = os.path.join(ckpt, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(shard, "rb") as f:
        data = f.read()
    manifest["files"]["deepspeed/mp_rank_00_model_states.pt"] = {"bytes": len(data),
                                                                  "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)

    done = _accum(tmp, "--resume", ckpt)
    assert done.returncode == 2, done.stderr[-3000:]  # bad input: the command exits 2
    assert not os.path.exists(marker)  # nothing of the file was run, on any rank
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(f"error: {shard}:" in line and "would import os.makedirs" in line for line in errors), \
        done.stderr[-4000:]
    assert "UnsafePickle" not in done.stderr  # no traceback of the worker's (torchrun prints its own summary)


def test_imports_are_read_off_the_opcodes_memo_included():
    # STACK_GLOBAL whose names come back from the memo (BINGET) after being pushed and popped
    data = (b"\x80\x04" + b"\x8c\x02os\x94" + b"\x8c\x08makedirs\x94" + b"00" + b"h\x00h\x01\x93" + b"N\x85R."
            )  # proto 4; 'os' memo 0; 'makedirs' memo 1; pop pop; get 0, get 1; STACK_GLOBAL; (None,) REDUCE
    assert pickle_scan.imports(data) == [("os", "makedirs")]
    # a module name computed at load time (str(...) of something) cannot be read off: reported as None
    computed = pickle.dumps(0, protocol=4)[:2] + (b"\x8c\x08builtins\x8c\x03str\x93" + b"\x8c\x02os\x85R"
                                                 + b"\x8c\x06system\x93.")
    assert pickle_scan.imports(computed) == [("builtins", "str"), None]


def _zip_with(tmp_path, data: bytes) -> str:
    path = str(tmp_path / "shard.pt")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("shard/data.pkl", data)
    return path


def test_refusals_name_the_file_and_the_import(tmp_path):
    good = io.BytesIO()
    torch.save({"w": torch.ones(2), "n": 3}, good)
    path = str(tmp_path / "good.pt")
    with open(path, "wb") as f:
        f.write(good.getvalue())
    pickle_scan.check_file(path)  # tensors, dicts, numbers: allowed

    evil = _zip_with(tmp_path, pickle.dumps(Payload(str(tmp_path / "m")), protocol=2))
    with pytest.raises(UnsafePickle, match=r"shard\.pt:shard/data\.pkl: would import os\.makedirs"):
        pickle_scan.check_file(evil)
    with pytest.raises(UnsafePickle, match="an import whose name is computed"):
        pickle_scan.check_file(_zip_with(tmp_path, b"\x80\x04\x8c\x08builtins\x8c\x03str\x93\x8c\x02os\x85R"
                                                   b"\x8c\x06system\x93."))
    raw = str(tmp_path / "legacy.pt")
    with open(raw, "wb") as f:
        pickle.dump({"a": 1}, f)
    with pytest.raises(UnsafePickle, match="not a torch zip archive"):
        pickle_scan.check_file(raw)
    assert not (tmp_path / "m").exists()
