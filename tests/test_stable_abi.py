"""The compiled library needs nothing of torch but its stable C ABI, so one build loads into
every torch of the supported range (the build flag TORCH_TARGET_VERSION already makes any
ATen or c10 header a compile error; this checks the result)."""

import re
import shutil
import subprocess

import pytest

from paged_attention_ext import _C

# Mangled C++ names in torch's namespaces (c10::, at::, torch::), const members included.
TORCH_CXX_SYMBOL = re.compile(r"^_ZN(K|V|VK)?(3c10|2at|5torch)")


def undefined_symbols(path: str) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return [line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_the_library_uses_no_torch_cxx_symbol():
    symbols = undefined_symbols(_C.__file__)
    assert [s for s in symbols if TORCH_CXX_SYMBOL.match(s)] == []
    # It does reach torch, through the C shim: the check above looks at the right list.
    assert any(s.startswith("aoti_torch_") for s in symbols)
