"""Mutation check: a deliberately broken engine must fail the tests.

    python bench/mutation.py                # every mutant (bench/mutants.py) against the default subset
    python bench/mutation.py --mutants a c  # some of them
    python bench/mutation.py --tests tests/accum_sched/test_engine_equivalence.py  # another subset
    python bench/mutation.py --first-failure  # pytest -x: stop each mutant's run at its first failing test

First the subset runs on the real engine (it must pass, or a failure under a mutant proves nothing). Then, per
mutant, a ``sitecustomize.py`` in a temporary directory first on PYTHONPATH installs the mutant in every interpreter
of the run (pytest, spawned ranks, torchrun workers), a one-line probe checks that the engine imported there is
the mutant, and pytest runs the subset. The table lists, per mutant, the tests that failed (each must fail at least
one: the script exits 1 otherwise) and the time taken. No product code is changed. See docs/testing.md.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from mutants import MUTANTS

# fast and to the point: exactness at world 1-3 (rank 0), every rank under a NaN window with partial windows
# (DDP, FSDP2), lockstep and its disagreements, all-reduce rounds per step, fp16 windows through the launcher
DEFAULT_TESTS = [
    "tests/accum_sched/test_engine_equivalence.py",
    "tests/accum_sched/test_nonfinite.py::test_nan_on_one_rank_is_skipped_on_every_rank",
    "tests/accum_sched/test_nonfinite.py::test_single_process_nan_in_a_window",
    "tests/accum_sched/test_engine_lockstep.py",
    "tests/launcher/train/test_fp16_windows.py",
]

SITECUSTOMIZE = """\
import importlib.util as _util
_spec = _util.spec_from_file_location("_accum_sched_mutants", {path!r})
_mutants = _util.module_from_spec(_spec)
_spec.loader.exec_module(_mutants)
_mutants.install({name!r})
"""

PROBE = "import accum_sched.engine as e; print(getattr(e, '_ACCUM_SCHED_MUTANT', None))"


def mutant_env(name: str | None, site_dir: str) -> dict:
    """The environment of a run: the worktree first on PYTHONPATH, after the mutant's sitecustomize if any."""
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if name is not None:
        with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE.format(path=os.path.join(BENCH, "mutants.py"), name=name))
        paths.insert(0, site_dir)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def probe(env: dict) -> str:
    """Which mutant the engine imported under ``env`` is ('None' for the real one); raises if the import fails."""
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine does not import under this mutant:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip()


def run_tests(tests: list[str], env: dict, first_failure: bool, timeout_s: int) -> tuple[list[str], float, str]:
    """(failed test ids, seconds, pytest's last lines). A run past ``timeout_s`` counts as one failure."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    if first_failure:
        cmd.insert(3, "-x")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=timeout_s)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return [f"(timed out after {timeout_s} s)"], time.monotonic() - start, out[-1500:]
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)))
    if proc.returncode not in (0, 1) and not failed:  # collection errors, internal errors, interrupted runs
        failed = [f"(pytest exit {proc.returncode})"]
    return failed, time.monotonic() - start, "\n".join(out.strip().splitlines()[-3:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", nargs="+", default=list(MUTANTS), choices=list(MUTANTS))
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    parser.add_argument("--first-failure", action="store_true", help="pytest -x (faster; lists one failure)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the subset on the real engine")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = parser.parse_args(argv)

    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="accum-sched-mutant-") as site_dir:
        if not args.skip_baseline:
            env = mutant_env(None, site_dir)
            assert probe(env) == "None", "the real engine is patched: is a sitecustomize already on PYTHONPATH?"
            failed, seconds, tail = run_tests(args.tests, env, False, args.timeout)
            print(f"baseline (real engine): {len(failed)} failed in {seconds:.0f} s", flush=True)
            if failed:
                print("the subset must pass on the real engine first:\n  " + "\n  ".join(failed) + "\n" + tail)
                return 1
        for name in args.mutants:
            env = mutant_env(name, site_dir)
            applied = probe(env)
            if applied != name:
                raise RuntimeError(f"mutant {name} is not in place (the engine reports {applied})")
            failed, seconds, tail = run_tests(args.tests, env, args.first_failure, args.timeout)
            rows.append((name, MUTANTS[name][0], failed, seconds))
            ok = ok and bool(failed)
            print(f"mutant {name} ({MUTANTS[name][0]}): {len(failed)} failed in {seconds:.0f} s", flush=True)
    print()
    print(f"{'mutant':<36} {'failed':>6} {'time':>6}  tests that failed")
    for name, what, failed, seconds in rows:
        label = f"{name}: {what}"
        shown = ", ".join(t.replace("tests/", "") for t in failed) or "NONE (the suite misses this mutant)"
        print(f"{label:<36} {len(failed):>6} {seconds:>5.0f}s  {shown}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
