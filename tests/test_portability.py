"""The library must load and run on any x86-64 CPU: AVX code only inside the ISA kernels."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import paged_attention_ext

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("objdump") is None,
    reason="needs x86-64 and objdump")

# VEX/EVEX-encoded instructions (AVX and later) start with 'v' in AT&T syntax.
VECTOR_EXTENSION = re.compile(r"\tv[a-z0-9]+\s")


def functions_using_avx(library: Path):
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(library)],
                             capture_output=True, text=True, check=True).stdout
    found, current = set(), None
    for line in listing.splitlines():
        if line.endswith(">:"):
            current = line
        elif current and VECTOR_EXTENSION.search(line):
            found.add(current)
    return found


def test_avx_instructions_only_in_runtime_dispatched_kernels():
    library = next(Path(paged_attention_ext.__file__).parent.glob("_C*.so"))
    # amx_emulated: the amx kernel on its tile model, compiled for avx512_bf16's instructions.
    kernels = [*paged_attention_ext.CPU_ISAS[1:], "amx_emulated"]
    outside = [f for f in functions_using_avx(library)
               if not any(f"paged::cpu::{isa}::" in f for isa in kernels)]
    assert not outside, f"AVX code outside the dispatched kernels: {outside[:5]}"
