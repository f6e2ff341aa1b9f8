"""Which rank failed first. When one rank raises (an exception in the task, a non-finite loss under
``nonfinite='raise'``), the others stop too, with errors of their own (a peer that closed its connection), and
torchrun's summary lists ranks in its own order: the cause is one traceback among several. Each worker that raises
notes ``<output_dir>/.failures/rank-<R>.json`` (time, rank, the exception's first line); `accum-sched run` then ends
with one line naming the rank that failed first and its error (docs/reliability.md). Standard library only.
"""
from __future__ import annotations

import json
import os
import time

FOLDER = ".failures"


def note(run_dir: str, rank: int, exc: BaseException, shown: bool = False) -> None:
    """Record that this rank raises ``exc`` now (best effort: never masks the exception itself). ``shown``: the
    worker printed it as its own one-line ``error:`` (bad input), which the command then does not repeat."""
    try:
        folder = os.path.join(run_dir, FOLDER)
        os.makedirs(folder, exist_ok=True)
        first = (str(exc).strip().splitlines() or [""])[0][:2000]
        record = {"time": time.time(), "rank": rank, "error": f"{type(exc).__name__}: {first}".rstrip(": "),
                  "shown": shown}
        tmp = os.path.join(folder, f"rank-{rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(folder, f"rank-{rank}.json"))
    except Exception:  # noqa: BLE001 -- a note about a failure must not fail
        pass


def first(run_dir: str, since: float, newest: bool = False) -> dict | None:
    """The earliest record written at or after ``since`` (a launch's start), or None. ``newest``: the latest
    instead (an elastic run, whose groups may fail and re-form several times in one launch)."""
    folder = os.path.join(run_dir, FOLDER)
    records = []
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    record = json.load(f)
                if isinstance(record, dict) and float(record.get("time", 0)) >= since:
                    records.append(record)
            except (OSError, ValueError, TypeError):
                continue
    pick = max if newest else min
    return pick(records, key=lambda r: float(r["time"])) if records else None
