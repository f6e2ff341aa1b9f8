"""Fixtures of the task tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the references run ~100 tiny forwards; with several threads on a loaded 2-core machine each took 40x longer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
