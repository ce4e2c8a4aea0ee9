"""The CPU kernels' instruction sets a test may select with PAGED_ATTENTION_CPU_ISA.

The kernel chosen by default can be below the best one the CPU runs (avx512_vbmi's where
bf16 dot products are slower than fp32 multiply-adds), so what a CPU supports is asked by
requesting each instruction set, not read from the default.
"""

import os

import pytest

import paged_attention_ext as pa

ISAS = list(pa.CPU_ISAS)


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs the kernel for ``isa`` (requesting it does not raise)."""
    saved = os.environ.get("PAGED_ATTENTION_CPU_ISA")
    os.environ["PAGED_ATTENTION_CPU_ISA"] = isa
    try:
        pa.cpu_isa()
        return True
    except ValueError:
        return False
    finally:
        if saved is None:
            del os.environ["PAGED_ATTENTION_CPU_ISA"]
        else:
            os.environ["PAGED_ATTENTION_CPU_ISA"] = saved


def supported_isas() -> list:
    return [isa for isa in ISAS if isa_supported(isa)]


def select_isa(isa: str, monkeypatch) -> None:
    """Run the rest of the test on ``isa``'s kernel, or skip where the CPU lacks it."""
    if not isa_supported(isa):
        pytest.skip(f"this CPU supports up to {supported_isas()[-1]}")
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", isa)
    assert pa.cpu_isa() == isa
