"""Where the tests and the repository are, for test modules at any depth under tests/ (tests/conftest.py puts
this folder on sys.path, so `import paths` works from every test folder)."""
import os
from pathlib import Path

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
TESTS_PATH = Path(TESTS)
ROOT_PATH = Path(ROOT)
