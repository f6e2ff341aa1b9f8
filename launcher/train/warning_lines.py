"""How a worker prints Python warnings: one plain line each, never the source line under it.

Python's default form is ``/path/accum_sched/engine.py:496: UserWarning: <message>`` followed by the line of code
that called ``warnings.warn``, which tells a user nothing. Ours (raised from accum_sched or launcher) read
``accum-sched: warning: <message>``; anyone else's keep their category and origin on the same line.
"""
from __future__ import annotations

import os
import warnings

_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), package)
              + os.sep for package in ("accum_sched", "launcher"))


def one_line(message, category, filename, lineno, line=None) -> str:
    """A ``warnings.formatwarning`` replacement: the warning on one line."""
    text = " ".join(str(message).split("\n"))
    if os.path.abspath(filename).startswith(_OURS):
        return f"accum-sched: warning: {text}\n"
    return f"warning: {category.__name__} ({os.path.basename(filename)}:{lineno}): {text}\n"


def install() -> None:
    """This process prints every warning as :func:`one_line` does (the worker's first act)."""
    warnings.formatwarning = one_line
