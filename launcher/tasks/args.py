"""What the built-ins' torch-free argument checks share (launcher/tasks/hf_args.py, stream_lm_args.py)."""
from __future__ import annotations

import difflib

from launcher.errors import ConfigError

FIELD = "task.args"


def refuse_unknown(args: dict, known: tuple[str, ...], task: str) -> None:
    """ConfigError naming the first argument of ``args`` that ``task`` does not take, with the closest known one."""
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            raise ConfigError(f"{FIELD}.{key}", f"unknown argument of {task}",
                              f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}")
