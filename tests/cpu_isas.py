"""The CPU kernels' instruction sets a test may select (``pa.select_cpu_isa``).

The kernel chosen by default can be below the best one the CPU runs (avx512_vbmi's where
bf16 dot products are slower than fp32 multiply-adds), so what a CPU supports is asked by
requesting each instruction set, not read from the default. conftest.py puts the default
back after each test.
"""

import pytest

import paged_attention_ext as pa

ISAS = list(pa.CPU_ISAS)


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs the kernel for ``isa`` (requesting it does not raise)."""
    current = pa.cpu_isa()
    try:
        pa.select_cpu_isa(isa)
        return True
    except ValueError:
        return False
    finally:
        pa.select_cpu_isa(current)


def supported_isas() -> list:
    return [isa for isa in ISAS if isa_supported(isa)]


def select_isa(isa: str) -> None:
    """Run the rest of the test on ``isa``'s kernel, or skip where the CPU lacks it."""
    if not isa_supported(isa):
        pytest.skip(f"this CPU supports up to {supported_isas()[-1]}")
    assert pa.select_cpu_isa(isa) == isa
    assert pa.cpu_isa() == isa
