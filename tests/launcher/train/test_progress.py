"""Rank 0's progress: a throttled one-line bar on a TTY, plain lines every log_every steps otherwise."""
import io
from types import SimpleNamespace

from launcher.train.metrics import Progress


def info(step, epoch=0):
    return SimpleNamespace(step=step, epoch=epoch, loss=0.5, factor=2, lr=1e-3)


def test_bar_is_throttled_and_always_shows_the_last_step():
    out = io.StringIO()
    bar = Progress("bar", epochs=1, total_steps=1000, log_every=10, stream=out)
    for step in range(1, 1001):
        bar.step(info(step), effective_batch=64)
    frames = out.getvalue().split("\r")[1:]
    assert 1 <= len(frames) < 50  # a thousand fast steps, a handful of redraws
    assert "step 1000/1000" in frames[-1] and "[" + "#" * 30 + "]" in frames[-1]


def test_plain_lines_every_log_every_steps():
    out = io.StringIO()
    plain = Progress("auto", epochs=2, total_steps=25, log_every=10, stream=out)  # StringIO is no TTY
    for step in range(1, 26):
        plain.step(info(step), effective_batch=64)
    plain.epoch_end(0, 0.5, 1.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[5] for line in lines[:-1]] == ["10/25", "20/25", "25/25"]
    assert lines[-1].startswith("epoch 0 of 0-1 done")
