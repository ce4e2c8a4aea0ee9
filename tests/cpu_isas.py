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


def amx_kernel() -> str:
    """The amx kernel as this CPU runs it: ``amx`` on AMX hardware, else its compile on the
    software model of the tiles, ``amx_emulated`` (which needs avx512_bf16)."""
    return "amx" if isa_supported("amx") else "amx_emulated"


def supported_kernels() -> list:
    """:func:`supported_isas`, plus the amx kernel on its tile model (``amx_emulated``) where
    the CPU lacks AMX but runs avx512_bf16."""
    isas = supported_isas()
    return isas + ["amx_emulated"] if isas[-1] == "avx512_bf16" else isas


def select_isa(isa: str, amx_model: bool = False) -> None:
    """Run the rest of the test on ``isa``'s kernel, or skip where the CPU lacks it. With
    ``amx_model``, ``amx`` runs on :func:`amx_kernel` (the tile model where AMX is missing)."""
    if amx_model and isa == "amx":
        isa = amx_kernel()
    if not isa_supported(isa):
        pytest.skip(f"this CPU supports up to {supported_isas()[-1]}")
    assert pa.select_cpu_isa(isa) == isa
    assert pa.cpu_isa() == isa
