"""Shared by every test folder: the helper modules in tests/ (cases, distributed, counters, the task modules the
launcher runs by "module:function") are importable from any depth, and the fixtures below give the paths and the
environment a launched worker needs to find both the repository and those task modules."""
from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import paths  # noqa: E402  (needs TESTS on sys.path)


@pytest.fixture(scope="session")
def repo_root() -> str:
    """The repository's root (what a worker's PYTHONPATH starts with)."""
    return paths.ROOT


@pytest.fixture
def worker_env() -> dict:
    """os.environ with the repository and tests/ first on PYTHONPATH: `accum-sched run` and its torchrun workers
    then import this checkout and find the tests' task modules (e.g. ``faulty_tasks:regression``)."""
    extra = [paths.ROOT, paths.TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(extra)}


def pytest_configure(config):
    """Byte-compile this checkout's packages and test helpers once, in the controlling process: each launch starts
    a CLI, torchrun and a Python per worker, and where PYTHONDONTWRITEBYTECODE is set (as on the CI machine) each of
    them would compile launcher/ and accum_sched/ from source again (about 0.2 s of CPU a worker, measured here; the
    suite starts hundreds). Python reads the caches where it may not write them, and compiles a file edited since
    from its source (a cache is checked against the source's timestamp)."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller did it
        return
    import compileall

    for name in ("accum_sched", "launcher", "tests"):
        compileall.compile_dir(os.path.join(paths.ROOT, name), quiet=1)
