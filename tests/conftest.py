import os
import sys

import pytest
import torch

# Test helpers (paged_case.py) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

import paged_attention_ext  # noqa: E402

SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_report_header(config):
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "not installed"
    return (f"paged_attention_ext from {os.path.dirname(paged_attention_ext.__file__)}, torch "
            f"{torch.__version__}, transformers {transformers_version}, CPU ISA {paged_attention_ext.cpu_isa()}")


def pytest_configure(config):
    # `make test TORCH=...` tests the package as pip installed it (packaging faults show):
    # the source tree must not shadow it.
    if os.environ.get("PAGED_ATTENTION_TEST_INSTALLED") == "1" and os.path.dirname(os.path.abspath(
            paged_attention_ext.__file__)) == os.path.join(SOURCE_TREE, "paged_attention_ext"):
        raise pytest.UsageError(f"PAGED_ATTENTION_TEST_INSTALLED=1 but paged_attention_ext was "
                                f"imported from the source tree ({paged_attention_ext.__file__})")


@pytest.fixture(autouse=True)
def default_cpu_kernel():
    """Tests that select a CPU kernel (cpu_isas.select_isa) leave the default to the next."""
    default = paged_attention_ext.cpu_isa()
    yield
    if paged_attention_ext.cpu_isa() != default:
        paged_attention_ext.select_cpu_isa(default)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine OpenMP workers that
    wait for a busy core make each op call orders of magnitude slower. Modules of tiny-model
    tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
