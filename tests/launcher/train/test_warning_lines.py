"""A worker's warnings (issue 37.12): one plain line each, without the source line Python prints under them, and
no third-party deprecation noise (torchdata's `set_vital`), silenced for that warning only."""
from __future__ import annotations

import os
import warnings

from test_streams_run import accum, numbers_config, write

import paths
from launcher.train.warning_lines import one_line

SHORT_EPOCH = """\
run: {output_dir: OUT, seed: 0, epochs: 1}
task: {target: builtin:regression, args: {samples: 64}}
data: {micro_batch_size: 16}
accumulation: {schedule: {0: 8}}
optimizer: {name: sgd, lr: 0.1}
lr_scheduler: null
distributed: {nproc_per_node: 1}
logging: {progress: none}
"""


def test_ours_and_theirs_on_one_line():
    engine = os.path.join(paths.ROOT, "accum_sched", "engine.py")
    assert one_line("epoch 0 has 4 micro-batches", UserWarning, engine, 496, "warnings.warn(...)") == (
        "accum-sched: warning: epoch 0 has 4 micro-batches\n")
    assert one_line(DeprecationWarning("old\nway"), DeprecationWarning, "/x/site-packages/y/z.py", 7) == (
        "warning: DeprecationWarning (z.py:7): old way\n")


def test_a_runs_engine_warning_is_one_plain_line(tmp_path):
    """4 micro-batches under factor 8: the engine warns that the epoch takes one step; stderr holds that one line."""
    proc = accum("run", write(str(tmp_path), "short", SHORT_EPOCH))
    said = [line for line in proc.stderr.splitlines() if "micro-batches, fewer than the factor" in line]
    assert said == ["accum-sched: warning: epoch 0 has 4 micro-batches, fewer than the factor 8: it takes one "
                    "optimizer step over all of them"], proc.stderr
    assert "warnings.warn(" not in proc.stderr and "engine.py" not in proc.stderr, proc.stderr


def test_a_stream_run_shows_no_set_vital_deprecation(tmp_path):
    """torchdata's StatefulDataLoader calls torch.set_vital, deprecated: its warning is dropped by message,
    category and module, while other warnings in the same place still show."""
    import torchdata  # noqa: F401  (the loader that warned; without it there is nothing to silence)

    proc = accum("run", numbers_config(str(tmp_path), "stream", world=1))
    assert "set_vital" not in proc.stderr, proc.stderr
    from launcher.train import streams

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streams.make_loader(range(4), batch_size=2, drop_last=False, num_workers=0, collate_fn=None,
                            pin_memory=False)
        warnings.warn("still shown", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["still shown"]
