import os
import sys

import pytest
import torch

# Test helpers (paged_case.py) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine OpenMP workers that
    wait for a busy core make each op call orders of magnitude slower. Modules of tiny-model
    tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
