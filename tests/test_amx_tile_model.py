"""The software model of the AMX tile instructions (csrc/cpu/amx_tile_model.h), on its own.

The amx_emulated kernel (tests/test_attention.py's amx tests, on CPUs without AMX) runs the
amx kernel over this model; here a small driver (tests/amx_tile_model_cases.cpp) checks the
model itself: tdpbf16ps against float64 products at full and partial tile shapes, its
denormal handling (inputs read as zero, results flushed), the bytes a store leaves alone, and
that each misuse the hardware would fault on aborts naming the instruction and the shapes.
Needs g++ (C++20); skipped without it.
"""

import os
import shutil
import signal
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    binary = str(tmp_path_factory.mktemp("amx_tile_model") / "cases")
    subprocess.run([compiler, "-std=c++20", "-O1", "-I", os.path.join(ROOT, "csrc", "cpu"),
                    os.path.join(ROOT, "tests", "amx_tile_model_cases.cpp"), "-o", binary], check=True)
    return binary


def bf16_bits(x: torch.Tensor) -> bytes:
    return x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def tile_dot(driver, a, b, c):
    """tdpbf16ps on the model: a [m, 2k] and b [k, 2n] bf16 (b in pairs), c [m, n] fp32."""
    m, n, k = c.shape[0], c.shape[1], b.shape[0]
    run = subprocess.run([driver, "dot", str(m), str(k), str(n)], check=True, capture_output=True,
                         input=bf16_bits(a) + bf16_bits(b) + c.numpy().tobytes())
    return torch.frombuffer(bytearray(run.stdout), dtype=torch.float32).view(m, 16)


@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (5, 3, 8), (1, 16, 2)])
def test_dpbf16ps_is_the_pair_product(driver, m, k, n):
    gen = torch.Generator().manual_seed(m * 100 + k)
    a = torch.randn(m, 2 * k, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, 2 * n, generator=gen).to(torch.bfloat16)
    c = torch.randn(m, n, generator=gen)
    out = tile_dot(driver, a, b, c)
    # b's row kk holds column j's elements 2kk and 2kk + 1 of the dot product at 2j, 2j + 1.
    b_full = b.double().view(k, n, 2).permute(0, 2, 1).reshape(2 * k, n)
    want = c.double() + a.double() @ b_full
    torch.testing.assert_close(out[:, :n].double(), want, atol=1e-5, rtol=1e-5)
    assert out[:, n:].isnan().all(), "tilestored wrote past the tile's bytes"


def test_dpbf16ps_denormals(driver):
    """Denormal bf16 inputs read as zero, denormal sums flush to zero (the SDM's DAZ / FTZ)."""
    a = torch.zeros(2, 2)
    b = torch.zeros(1, 2)
    a[0, 0] = 2.0 ** -130  # denormal bf16: its product with 2^100 would be 2^-30
    b[0, 0] = 2.0 ** 100
    a[1, 1], b[0, 1] = 2.0 ** -70, 2.0 ** -70  # a normal product of 2^-140: denormal, flushed
    out = tile_dot(driver, a, b, torch.zeros(2, 1))
    assert out[0, 0].item() == 0.0 and out[1, 0].item() == 0.0
    a[0, 0] = 2.0 ** -126  # the smallest normal: 2^-26, kept
    assert tile_dot(driver, a, b, torch.zeros(2, 1))[0, 0].item() == 2.0 ** -26


@pytest.mark.parametrize("case,message", [
    ("before_config", "tileloadd: tmm0 used before ldtilecfg"),
    ("after_release", "tilestored: tmm0 used before ldtilecfg (or after tilerelease)"),
    ("unconfigured_tile", "tilezero: tmm5 is not configured"),
    ("palette", "ldtilecfg: palette 2"),
    ("too_many_bytes", "ldtilecfg: tmm1 of 16 rows x 128 bytes (at most 16 x 64)"),
    ("reserved", "ldtilecfg: reserved byte 5 is 1, not 0"),
    ("start_row", "ldtilecfg: start_row 2"),
    ("tile_8", "ldtilecfg: tile 8 configured (16 rows x 64 bytes) but palette 1 has 8 tiles"),
    ("rows_without_bytes", "ldtilecfg: tmm3 of 4 rows x 0 bytes"),
    ("a_bytes_not_dwords", "tmm1 (A) 16 x 62 bytes, tmm2 (B) 15 x 64 bytes: shapes disagree"),
    ("a_rows", "tdpbf16ps: tmm0 (C) 16 x 64 bytes, tmm1 (A) 8 x 64 bytes, tmm2 (B) 16 x 64 bytes: shapes disagree"),
    ("a_bytes", "tmm1 (A) 16 x 32 bytes, tmm2 (B) 16 x 64 bytes: shapes disagree"),
    ("b_bytes", "tmm1 (A) 16 x 64 bytes, tmm2 (B) 16 x 32 bytes: shapes disagree"),
    ("repeat", "tdpbf16ps: tmm0, tmm1, tmm1: a register repeats"),
])
def test_a_misuse_aborts_naming_it(driver, case, message):
    run = subprocess.run([driver, case], capture_output=True, text=True)
    assert run.returncode == -signal.SIGABRT, (run.returncode, run.stdout, run.stderr)
    assert run.stderr.startswith("amx tile model: ") and message in run.stderr, run.stderr
