"""paged.attention and its variants against the reference, on adversarial layouts.

The scenarios shared with the CUDA tests live in attention_scenarios.py; this module runs
them on the CPU and adds the CPU kernel's own cases (instruction sets, thread counts,
work splits).
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import attention_scenarios as scenarios
import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_attention_ext import token_quantization
from cpu_isas import ISAS, amx_kernel, select_isa, supported_isas, supported_kernels
from paged_case import DTYPES, free_out_of_window, make_case, query_start_loc, random_query


def assert_matches_reference(query, case, scale, **kwargs):
    return scenarios.assert_matches_reference("cpu", query, case, scale, **kwargs)


@pytest.mark.parametrize("case", scenarios.scenario_cases(), ids=str)
def test_attention_scenario(case):
    case.run("cpu")


@pytest.mark.parametrize("isa", pa.CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instruction_set(isa, dtype):
    select_isa(isa, amx_model=True)
    lens = [1, 15, 16, 17, 100, 0]
    sinks = scenarios.random_sinks(8)
    # (key, value) head sizes: 128 has its own compile of the kernel; 64 and 192/128 take
    # the general one, 72 and 40/128 its ragged path, and 80/64 reads rows in place with
    # bf16 dot products (avx512_bf16) for the values only.
    for head_size, head_size_v in ((64, 64), (72, 72), (128, 128), (192, 128), (40, 128), (80, 64)):
        case = make_case(lens, 2, head_size, 16, dtype, head_size_v=head_size_v)
        query = random_query(len(lens), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5)
        assert_matches_reference(query, case, head_size ** -0.5, sinks=sinks)
        qsl = query_start_loc([1, 3, 16, 17, 40, 0])
        query = random_query(int(qsl[-1]), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl,
                                 soft_cap=20.0, sinks=sinks)
        # A sliding layer's table with the blocks before the window freed (-1 / stale, NaN).
        for q_lens in (None, [1, 3, 16, 17, 40, 0]):
            freed = free_out_of_window(case, 17, q_lens)
            assert freed.freed > 0
            qsl = None if q_lens is None else query_start_loc(q_lens)
            query = random_query(len(lens) if q_lens is None else sum(q_lens), 8, head_size, dtype)
            assert_matches_reference(query, freed, head_size ** -0.5, query_start_loc=qsl,
                                     sliding_window=17, sinks=sinks)




@pytest.mark.parametrize("isa", pa.CPU_ISAS)
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn, torch.int8, torch.uint8],
                         ids=["float", "e4m3", "int8", "int4"])
def test_head_sizes_past_256(isa, fp8):
    """Gemma-4's global layers (head 512, GQA 4:1) and MLA's latent rows (keys 576 wide,
    values their leading 512 columns, 16 query heads on the one latent head), decode and
    multi-token, with sinks and soft cap, on each ISA and query dtype; float, fp8 and
    per-token caches."""
    select_isa(isa)
    lens = [1, 15, 16, 17, 100, 0]
    for i, dtype in enumerate(DTYPES):
        cache_dtype = dtype if fp8 is None else torch.float32
        gemma, gemma_extra = scenarios.with_format(
            make_case(lens, 2, 512, 16, cache_dtype),
            scenarios.KVFormat(fp8, layout=["HND", "NHD"][i % 2]))
        latent, latent_extra = scenarios.latent_case(lens, 16, cache_dtype, fp8)
        for case, extra, heads, head_size in ((gemma, gemma_extra, 8, 512),
                                              (latent, latent_extra, 16, 576)):
            for q_lens in (None, [1, 3, 16, 17, 40, 0]):
                qsl = None if q_lens is None else query_start_loc(q_lens)
                query = random_query(len(lens) if q_lens is None else sum(q_lens), heads,
                                     head_size, dtype)
                assert_matches_reference(query, case, 192 ** -0.5, query_start_loc=qsl,
                                         soft_cap=0.0 if qsl is None else 30.0,
                                         sinks=scenarios.random_sinks(heads), **extra)


@pytest.mark.parametrize("isa", pa.CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_output_rows_at_their_strides(isa, dtype):
    """Kernels write (one partition) fp32, bf16 and fp16 outputs straight into the caller's rows:
    each row at out's strides, nothing past head_size_v (padded head sizes included), the
    same values as a fresh output, and lse alike; a long sequence's partitions take the
    merge instead, into the same strided rows."""
    select_isa(isa, amx_model=True)
    for head_size, lens in ((128, [1, 17, 300, 0]), (72, [5, 33]), (128, [2000])):
        case = make_case(lens, 2, head_size, 16, dtype)
        for q_lens in (None, [1, 3, 40, 0][:len(lens)]):
            qsl = None if q_lens is None else query_start_loc(q_lens)
            tokens = len(lens) if q_lens is None else sum(q_lens)
            query = random_query(tokens, 8, head_size, dtype)
            args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                    head_size ** -0.5)
            want, want_lse = pa.attention_with_lse(*args, query_start_loc=qsl)
            wide = torch.full((tokens, 8, 2 * head_size), float("nan"), dtype=dtype)
            lse = torch.full((tokens, 2 * 8), float("nan"))[:, :8]
            pa.attention_out(wide[:, :, :head_size], *args, query_start_loc=qsl, lse=lse)
            torch.testing.assert_close(wide[:, :, :head_size], want, atol=0, rtol=0)
            torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
            assert wide[:, :, head_size:].isnan().all(), "a row was written past head_size_v"
            assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp8", scenarios.FP8_DTYPES + scenarios.TOKEN_DTYPES, ids=str)
def test_every_instruction_set_fp8(isa, fp8):
    """fp8 (and per-token int8 / int4) caches on each ISA's conversion (F16C / AVX-512 /
    scalar; per-token rows widened with their scales), with each query dtype,
    per-layer and per-head scales, whole-vector, ragged and mixed head sizes, and
    special stored values (NaN in a visible row must reach the output, as in the
    reference; subnormals and the largest values convert exactly). Lengths around the
    block (16) and around the fp8 decode chunk (64 keys at head sizes up to 128)."""
    select_isa(isa, amx_model=True)
    lens = [1, 15, 16, 17, 63, 64, 65, 100, 129, 0]
    for i, (head_size, head_size_v) in enumerate(((64, 64), (72, 72), (128, 128), (192, 128),
                                                  (40, 128), (80, 64))):
        dtype = DTYPES[i % 3]
        kv = scenarios.KVFormat(fp8, per_head_scales=i % 2 == 1, layout=["HND", "NHD"][i // 3 % 2])
        case, extra = scenarios.with_format(make_case(lens, 2, head_size, 16, torch.float32,
                                                      head_size_v=head_size_v), kv)
        query = random_query(len(lens), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, **extra)
        qsl = query_start_loc([1, 3, 16, 17, 2, 1, 5, 40, 3, 0])
        query = random_query(int(qsl[-1]), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl,
                                 soft_cap=20.0, sinks=scenarios.random_sinks(8), **extra)
    # One query head per KV head with a bf16 query: the avx512_bf16 path's e4m3 keys go
    # through vdpbf16ps (k_scale applied to the scores), a path GQA groups do not take.
    for per_head in (False, True):
        kv = scenarios.KVFormat(fp8, per_head_scales=per_head)
        case, extra = scenarios.with_format(make_case(lens, 2, 128, 16, torch.float32), kv)
        query = random_query(len(lens), 2, 128, torch.bfloat16)
        assert_matches_reference(query, case, 128 ** -0.5, soft_cap=30.0,
                                 sinks=scenarios.random_sinks(2), **extra)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int4_rows_under_a_16_bit_query(isa, dtype):
    """int4 rows under a 16-bit query, which avx512_bf16 reads in place by vdpbf16ps
    (nibbles as bf16 128 + n, the 128 taken back by the scale and low terms) where the
    head sizes are whole 64-channel steps: rows of scales from 1e-20 up (keys to about 3,
    values to 1e4), constant rows (scale 0), NaN in unused slots' codes and scales,
    lengths around the block, GQA 1 / 4 / 8, head sizes 64 to 512 (and a ragged one),
    decode and a few query rows per sequence (causal masks in place)."""
    select_isa(isa)
    bs = 16
    lens = [1, bs - 1, bs, bs + 1, 100, 0]
    gen = torch.Generator().manual_seed(5)
    for head_size in (64, 128, 192, 256, 512, 96):
        case = make_case(lens, 2, head_size, bs, torch.float32)
        slots = case.key_cache.shape[:3]
        key_scale = 10.0 ** (torch.rand(slots, generator=gen) * 20.5 - 20)
        value_scale = 10.0 ** (torch.rand(slots, generator=gen) * 24 - 20)
        key_cache = case.key_cache * key_scale[..., None]
        value_cache = case.value_cache * value_scale[..., None]
        # Rows whose rotation is constant: quantized with scale 0.
        constant = torch.rand(slots, generator=gen) < 0.2
        key_cache[constant] = token_quantization.unrotate(torch.full((head_size,), 0.7))
        value_cache[constant] = token_quantization.unrotate(torch.full((head_size,), -3.0))
        zero = torch.rand(slots, generator=gen) < 0.1
        key_cache[zero] = 0.0
        value_cache[zero] = 0.0
        case = dataclasses.replace(case, key_cache=key_cache, value_cache=value_cache)
        case, extra = scenarios.with_format(case, scenarios.KVFormat(torch.uint8))
        scenarios.poison_unused(case, float("nan"), extra)
        for group in (1, 4, 8):
            query = random_query(len(lens), 2 * group, head_size, dtype)
            assert_matches_reference(query, case, head_size ** -0.5, **extra)
        qsl = query_start_loc([1, 3, 5, 7, 2, 0])
        query = random_query(int(qsl[-1]), 2, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, **extra)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp8", scenarios.FP8_DTYPES)
def test_fp8_conversion_of_every_byte(isa, fp8):
    """Each of the 256 bytes dequantizes as torch converts it, times the scale: as a key
    (finite bytes; the lse of one visible key is its score) and as a value (every byte,
    infinities and NaN included; the output of one visible key is its value)."""
    select_isa(isa)
    every = torch.arange(256, dtype=torch.uint8)
    want = every.view(fp8).float() * 0.75
    head_size = 64
    key_cache = torch.zeros(16, 1, 16, head_size, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    # Key / value j (block j // 16, slot j % 16) holds byte j in lane 0, zeros elsewhere.
    finite_bytes = torch.where(want.isfinite(), every, torch.zeros_like(every))
    key_cache.view(torch.uint8)[:, 0, :, 0] = finite_bytes.view(16, 16)
    value_cache.view(torch.uint8)[:, 0, :, 0] = every.view(16, 16)
    query = torch.zeros(256, 1, head_size)
    query[:, 0, 0] = 1.0  # one-hot: the score is lane 0 of the key
    tables = torch.arange(16, dtype=torch.int32).expand(256, 16).contiguous()
    lens = torch.arange(1, 257, dtype=torch.int32)  # row j's query sits at position j
    scale = torch.tensor(0.75)
    # Window 1: row j sees key j alone.
    out, lse = pa.attention_with_lse(query, key_cache, value_cache, tables, lens, 1.0,
                                     sliding_window=1, k_scale=scale, v_scale=scale)
    finite = want.isfinite()
    assert torch.equal(lse[finite, 0], want[finite])
    assert torch.equal(out[:, 0, 0].isnan(), want.isnan())
    assert torch.equal(out[~want.isnan(), 0, 0], want[~want.isnan()])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_conversion_of_every_value(isa, dtype):
    """Each int8 times its row's scale, as a key (the lse of one visible key is its score)
    and as a value (the output of one visible key): exact on every kernel, the byte-table
    lookups into vdpbf16ps (a bf16 query) included, and -128 too, which write_kv never
    stores but another writer may."""
    select_isa(isa)
    every = torch.arange(-128, 128, dtype=torch.int8)
    head_size = 64
    key_cache = torch.zeros(16, 1, 16, head_size, dtype=torch.int8)
    value_cache = torch.zeros_like(key_cache)
    key_cache[:, 0, :, 0] = every.view(16, 16)
    value_cache[:, 0, :, 0] = every.view(16, 16)
    k_scale, v_scale = torch.full((16, 1, 16), 0.5), torch.full((16, 1, 16), 0.25)
    query = torch.zeros(256, 1, head_size, dtype=dtype)
    query[:, 0, 0] = 1.0
    tables = torch.arange(16, dtype=torch.int32).expand(256, 16).contiguous()
    lens = torch.arange(1, 257, dtype=torch.int32)
    out, lse = pa.attention_with_lse(query, key_cache, value_cache, tables, lens, 1.0,
                                     sliding_window=1, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(lse[:, 0], every.float() * 0.5)
    assert torch.equal(out[:, 0, 0].float(), every.float() * 0.25)


# (query heads, KV heads): groups of 1 to 8 queries per KV head, so every register-tile
# shape of each ISA runs (AVX2: 2 x 4 tiles, and for fp8 rows 4 x 2 tiles with a 2 x 4 tile
# for a pair left over, then single queries; AVX-512: 4 x 4), in decode and with several
# query rows per sequence.
TILE_HEADS = [(3, 3), (6, 3), (6, 2), (8, 2), (12, 2), (8, 1)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES + list(scenarios.FP8_DTYPES + scenarios.TOKEN_DTYPES), ids=str)
def test_register_tiles_on_every_instruction_set(isa, dtype):
    select_isa(isa, amx_model=True)
    lens = [1, 31, 32, 33, 70]
    for num_heads, num_kv_heads in TILE_HEADS:
        for head_size in (64, 128):
            base = make_case(lens, num_kv_heads, head_size, 16, torch.float32 if dtype.itemsize == 1 else dtype)
            case, extra = (scenarios.with_format(base, scenarios.KVFormat(dtype))
                           if dtype.itemsize == 1 else (base, {}))
            query_dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype
            for q_lens in (None, [1, 3, 2, 5, 4]):
                qsl = None if q_lens is None else query_start_loc(q_lens)
                query = random_query(len(lens) if q_lens is None else sum(q_lens), num_heads,
                                     head_size, query_dtype)
                assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, **extra)


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_conversion_of_every_bit_pattern(isa):
    """Each of the 65536 fp16 bit patterns (subnormals, infinities, NaN included) comes out
    of the value path exactly: row j's query sees value row j alone, which holds 64 patterns."""
    select_isa(isa)
    head_size, rows = 64, 1024
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    value_cache = patterns.view(rows // 16, 1, 16, head_size).clone()
    key_cache = torch.zeros_like(value_cache)
    tables = torch.arange(rows // 16, dtype=torch.int32).expand(rows, rows // 16).contiguous()
    lens = torch.arange(1, rows + 1, dtype=torch.int32)  # row j's query sits at position j
    query = torch.zeros(rows, 1, head_size, dtype=torch.float16)
    out = pa.attention(query, key_cache, value_cache, tables, lens, 1.0, sliding_window=1)
    want = patterns.view(rows, 1, head_size)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("layout", ["NHD", "joint", "padded", "odd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_layouts_on_every_instruction_set(layout, dtype):
    """Blocks, heads and tokens addressed by stride, also with unaligned (odd) rows, on
    each ISA (and the amx kernel's tile model where the CPU lacks AMX): float caches of
    each dtype, an fp8 and a per-token cache (scales alike) per layout."""
    lens = [1, 15, 16, 17, 100, 0]
    for isa in supported_kernels():
        select_isa(isa)
        for head_size, head_size_v in ((128, 128), (72, 40)):
            case, extra = scenarios.with_format(
                make_case(lens, 2, head_size, 16, dtype, head_size_v=head_size_v),
                scenarios.KVFormat(layout=layout))
            query = random_query(len(lens), 4, head_size, dtype)
            assert_matches_reference(query, case, head_size ** -0.5, **extra)
        fp8 = scenarios.FP8_DTYPES[DTYPES.index(dtype) % 2]
        case, extra = scenarios.with_format(make_case(lens, 2, 64, 16, torch.float32),
                                            scenarios.KVFormat(fp8, True, layout))
        assert_matches_reference(random_query(len(lens), 4, 64, dtype), case, 0.125, **extra)
        token = scenarios.TOKEN_DTYPES[DTYPES.index(dtype) % 2]
        case, extra = scenarios.with_format(make_case(lens, 2, 64, 16, torch.float32),
                                            scenarios.KVFormat(token, layout=layout))
        assert_matches_reference(random_query(len(lens), 4, 64, dtype), case, 0.125, **extra)


def test_default_instruction_set(monkeypatch):
    """The default kernel is one the CPU runs; it is the best one, except avx512_vbmi's in
    place of avx512_bf16's where bf16 dot products do not pay (either stays requestable)."""
    monkeypatch.delenv("PAGED_ATTENTION_CPU_ISA", raising=False)
    default, supported = pa.select_cpu_isa(), supported_isas()
    assert default in supported
    assert default == supported[-1] or (default, supported[-1]) == ("avx512_vbmi", "avx512_bf16")


def test_the_kernel_changes_only_through_select_cpu_isa(monkeypatch):
    """The variable is read when the kernel is chosen, not on each call."""
    before = pa.cpu_isa()  # the run's own choice (PAGED_ATTENTION_CPU_ISA may have lowered it)
    top = supported_isas()[-1]
    try:
        assert pa.select_cpu_isa(top) == top
        monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", "generic")
        assert pa.cpu_isa() == top
        assert pa.select_cpu_isa() == "generic" and pa.cpu_isa() == "generic"
        monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", top)
        assert pa.cpu_isa() == "generic"
    finally:
        pa.select_cpu_isa(before)


@pytest.mark.parametrize("request_", ["sse9", "AVX2"])
def test_unknown_instruction_set_is_rejected_and_the_choice_kept(request_, monkeypatch):
    """The refusal names what the caller used: the argument, or the variable."""
    before = pa.cpu_isa()
    with pytest.raises(ValueError, match=f"^select_cpu_isa's isa must be one of generic, .*; got '{request_}'$"):
        pa.select_cpu_isa(request_)
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", request_)
    with pytest.raises(ValueError, match=f"^PAGED_ATTENTION_CPU_ISA must be one of generic, .*; got '{request_}'$"):
        pa.select_cpu_isa()
    assert pa.cpu_isa() == before


def test_an_instruction_set_beyond_the_cpu_is_rejected(monkeypatch):
    beyond = ISAS[len(supported_isas()):]
    if not beyond:
        pytest.skip("this CPU runs every kernel")
    with pytest.raises(ValueError, match=rf"^select_cpu_isa\('{beyond[0]}'\) but this CPU supports at most "):
        pa.select_cpu_isa(beyond[0])
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", beyond[0])
    with pytest.raises(ValueError, match=f"^PAGED_ATTENTION_CPU_ISA={beyond[0]} but this CPU supports at most "):
        pa.select_cpu_isa()


def test_amx_emulated_only_when_asked(monkeypatch):
    """The amx kernel on the software model of its tiles is a testing aid: never the
    default, not a rank of CPU_ISAS, chosen by name or by the variable where the CPU runs
    avx512_bf16 (the instruction set it is compiled for), refused elsewhere."""
    assert "amx_emulated" not in pa.CPU_ISAS
    monkeypatch.delenv("PAGED_ATTENTION_CPU_ISA", raising=False)
    assert pa.select_cpu_isa() != "amx_emulated"
    with pytest.raises(ValueError, match=r"^select_cpu_isa's isa must be one of generic, .*, amx or "
                                         r"amx_emulated \(the amx kernel on "):
        pa.select_cpu_isa("amx-emulated")
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", "amx_emulated")
    if "avx512_bf16" in supported_isas():
        assert pa.select_cpu_isa() == "amx_emulated" == pa.cpu_isa()
        return
    before = pa.cpu_isa()
    refusal = r" needs avx512_bf16 \(its instruction set\) but this CPU supports at most "
    with pytest.raises(ValueError, match=r"^PAGED_ATTENTION_CPU_ISA=amx_emulated" + refusal):
        pa.select_cpu_isa()
    with pytest.raises(ValueError, match=r"^select_cpu_isa\('amx_emulated'\)" + refusal):
        pa.select_cpu_isa("amx_emulated")
    assert pa.cpu_isa() == before


@pytest.mark.parametrize("request_, error", [("sse9", "must be one of"), ("amx", "but this CPU supports")])
def test_a_refused_variable_at_startup_fails_every_call(request_, error):
    """As when the variable was read per call: a process started with a bad request raises
    on every call until a kernel is selected."""
    if request_ == "amx" and "amx" in supported_isas():
        pytest.skip("this CPU runs amx")
    script = (
        "import torch, paged_attention_ext as pa\n"
        "from paged_case import make_case, random_query\n"
        "case = make_case([5], 2, 64, 16, torch.float32)\n"
        "args = (random_query(1, 4, 64, torch.float32), case.key_cache, case.value_cache,\n"
        "        case.block_tables, case.seq_lens, 0.125)\n"
        "for call in (pa.cpu_isa, lambda: pa.attention(*args), lambda: pa.attention(*args)):\n"
        "    try:\n"
        "        call()\n"
        "        print('ran')\n"
        "    except ValueError as e:\n"
        "        print('ValueError', e)\n"
        "pa.select_cpu_isa('generic')\n"
        "pa.attention(*args)\n"
        "print('ran', pa.cpu_isa())\n")
    env = dict(os.environ, PAGED_ATTENTION_CPU_ISA=request_,
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "ran generic", lines
    assert all(line.startswith("ValueError PAGED_ATTENTION_CPU_ISA") and error in line for line in lines[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_long_context_on_one_thread(dtype):
    # The partitions and their merge, with every item on one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scenarios.split_kv_long_context("cpu", dtype)
        scenarios.sinks_split_kv_long_context("cpu", dtype)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_split_kv_is_exact_across_thread_counts(with_sinks):
    # One thread splits the keys into 4 partitions, two into 8; the sink must count once
    # in either merge.
    case = make_case([6000], 1, 128, 16, torch.float32)
    query = random_query(1, 8, 128, torch.float32)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    sinks = torch.linspace(-2.0, 9.0, 8) if with_sinks else None
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = pa.attention_with_lse(*args, sinks=sinks)
        torch.set_num_threads(2)
        split = pa.attention_with_lse(*args, sinks=sinks)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,group,lens", [
    (8, 1, [40]),          # one short sequence: its KV heads are split across work items
    (32, 1, [3000]),       # one long sequence: key partitions, each holding every KV head
    (8, 4, [3000, 17]),    # partitions and GQA groups together
    (3, 2, [700, 1, 33]),  # a KV head count that does not split evenly
])
def test_work_splits(dtype, num_kv_heads, group, lens):
    case = make_case(lens, num_kv_heads, 128, 16, dtype)
    query = random_query(len(lens), num_kv_heads * group, 128, dtype)
    assert_matches_reference(query, case, 128 ** -0.5)
    # Each row's sink is taken by exactly one of the items that share its keys.
    assert_matches_reference(query, case, 128 ** -0.5,
                             sinks=scenarios.random_sinks(num_kv_heads * group))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16] + list(scenarios.FP8_DTYPES + scenarios.TOKEN_DTYPES),
                         ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64, 8])
def test_amx_tiles(cache_dtype, block_size):
    """The amx kernel's own edges (per-token caches: handed to the vector kernel): query tiles of 2 to 16 queries and KV heads of more
    (balanced tiles with padding; one query per KV head, MHA decode, is the vector kernel's
    fallback, its multi-token rows take the tiles), decode tiles of 2, 4 and 8 queries with
    compact score rows, key groups of 16 inside blocks of 16-64 (8: the fallback), chunks
    that start mid-group (windows, causal partitions), NaN in every unused slot, and the
    softmax features it shares with the general kernel. On the tiles, or on their software
    model (amx_emulated) where the CPU lacks AMX."""
    select_isa(amx_kernel())
    lens = scenarios.edge_lengths(block_size) + [100, 700]
    for num_heads, num_kv_heads in ((4, 4), (4, 2), (8, 2), (16, 2), (20, 1), (48, 3)):
        kv = scenarios.KVFormat(None if cache_dtype == torch.bfloat16 else cache_dtype,
                                per_head_scales=num_kv_heads > 1)
        case, extra = scenarios.with_format(
            make_case(lens, num_kv_heads, 128, block_size,
                      torch.bfloat16 if kv.cache_dtype is None else torch.float32), kv)
        query = random_query(len(lens), num_heads, 128, torch.bfloat16)
        assert_matches_reference(query, case, 128 ** -0.5, **extra)
        assert_matches_reference(query, case, 128 ** -0.5, sliding_window=37,
                                 sinks=scenarios.random_sinks(num_heads), **extra)
        q_lens = [min(n, q) for n, q in zip(lens, [1, 1, 5, 17, 40, 100, 300])]
        qsl = query_start_loc(q_lens)
        query = random_query(int(qsl[-1]), num_heads, 128, torch.bfloat16)
        assert_matches_reference(query, case, 128 ** -0.5, query_start_loc=qsl, **extra)
        assert_matches_reference(query, case, 128 ** -0.5, query_start_loc=qsl, soft_cap=20.0,
                                 alibi_slopes=scenarios.alibi(num_heads), sliding_window=45,
                                 **extra)


@pytest.mark.parametrize("cache_dtype,head_size,head_size_v", [
    (torch.bfloat16, 32, 32), (torch.bfloat16, 32, 64), (torch.bfloat16, 96, 160),
    (torch.bfloat16, 256, 256), (torch.float8_e4m3fn, 64, 192), (torch.float8_e4m3fn, 256, 256)],
    ids=str)
def test_amx_head_sizes(cache_dtype, head_size, head_size_v):
    """The amx kernel spreads a tile's score products (one per 32 key elements) and value
    products (one per 16 output columns) over the 16 row pairs of another tile's softmax:
    1 to 8 score parts and 2 to 16 value parts, key and value head sizes apart (on the tile
    model where the CPU lacks AMX)."""
    select_isa(amx_kernel())
    kv = scenarios.KVFormat(None if cache_dtype == torch.bfloat16 else cache_dtype, per_head_scales=True)
    case, extra = scenarios.with_format(
        make_case([1, 15, 16, 17, 100, 333], 2, head_size, 16,
                  torch.bfloat16 if kv.cache_dtype is None else torch.float32, head_size_v=head_size_v), kv)
    query = random_query(6, 8, head_size, torch.bfloat16)
    assert_matches_reference(query, case, head_size ** -0.5, **extra)
    qsl = query_start_loc([1, 15, 16, 17, 50, 200])
    query = random_query(int(qsl[-1]), 8, head_size, torch.bfloat16)
    assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, **extra)
    assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, sliding_window=20,
                             sinks=scenarios.random_sinks(8), **extra)


@pytest.mark.parametrize("cache_dtype,head_size,head_size_v", [
    (torch.bfloat16, 64, 64), (torch.bfloat16, 128, 256), (torch.bfloat16, 256, 128),
    (torch.float8_e4m3fn, 64, 128), (torch.float8_e4m3fn, 256, 256), (torch.float8_e5m2, 128, 64)],
    ids=str)
def test_lane_pairs_head_sizes(cache_dtype, head_size, head_size_v):
    """On avx512_bf16 the keys every row of a causal tile sees (queries in lanes) take
    vdpbf16ps for bf16 and fp8 caches under a bf16 query: 32 to 128 key pairs, value rows
    interleaved in key pairs (odd chunk lengths pair the last key with zeros), soft cap and
    sinks; fp8 with per-head scales."""
    select_isa("avx512_bf16")
    kv = scenarios.KVFormat(None if cache_dtype == torch.bfloat16 else cache_dtype, per_head_scales=True)
    lens = [97, 160, 333, 511]
    case, extra = scenarios.with_format(
        make_case(lens, 2, head_size, 16, torch.bfloat16 if kv.cache_dtype is None else torch.float32,
                  head_size_v=head_size_v), kv)
    qsl = query_start_loc([33, 64, 131, 77])
    query = random_query(int(qsl[-1]), 8, head_size, torch.bfloat16)
    assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, **extra)
    assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl, soft_cap=30.0,
                             sinks=scenarios.random_sinks(8), **extra)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("trend", ["rising", "falling", "spikes"])
def test_running_max(isa, trend):
    """Every kernel's softmax moves a query's running max only when a score passes it by a
    margin (lazy rescale; amx: 2^8, the others e^8): scores that rise along the sequence
    move it step after step (the accumulators rescaled), falling ones never, and rare spikes
    far above the rest move it once in a while. Wide scores (std ~20) so every branch is
    taken; output and lse both checked, for decode (GQA and MHA) and multi-token rows."""
    select_isa(isa, amx_model=True)
    lens, block_size = [900, 257, 40], 16
    case = make_case(lens, 2, 128, block_size, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for seq, n in enumerate(lens):
        blocks = -(-n // block_size)
        for b in range(blocks):
            physical = int(case.block_tables[seq, b])
            if trend == "rising":
                factor = 0.5 + 4.0 * b / blocks
            elif trend == "falling":
                factor = 4.5 - 4.0 * b / blocks
            else:
                factor = 6.0 if torch.rand(1, generator=gen).item() < 0.1 else 1.0
            case.key_cache[physical] = (case.key_cache[physical].float() * factor).to(torch.bfloat16)
    for num_heads in (8, 2):
        query = (random_query(len(lens), num_heads, 128, torch.bfloat16).float() * 3.0).to(torch.bfloat16)
        assert_matches_reference(query, case, 128 ** -0.5)
    q_lens = [300, 100, 40]
    qsl = query_start_loc(q_lens)
    query = (random_query(int(qsl[-1]), 8, 128, torch.bfloat16).float() * 3.0).to(torch.bfloat16)
    assert_matches_reference(query, case, 128 ** -0.5, query_start_loc=qsl)


def test_random_shapes_match_reference():
    """Seeded random mixes of dtype, heads, key and value head and block size, lengths,
    window, sinks and multi-token rows: the traversal (spans of blocks, heads within them,
    ragged chunks) must agree with the reference everywhere."""
    rng = torch.Generator().manual_seed(5)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    for seed in range(60):
        dtype = pick(DTYPES)
        kv_heads, group = pick([1, 2, 3, 4, 8]), pick([1, 2, 4, 8])
        head_size, block_size = pick([16, 48, 64, 72, 128, 256]), pick([1, 5, 8, 16, 24, 32, 64])
        head_size_v = pick([head_size, head_size, 8, 64, 128])
        lens = [pick([1, max(1, block_size - 1), block_size, block_size + 1,
                      int(torch.randint(1, 700, (1,), generator=rng))])
                for _ in range(pick([1, 2, 3, 5, 16]))]
        case = make_case(lens, kv_heads, head_size, block_size, dtype, seed=seed,
                         head_size_v=head_size_v)
        kwargs = {"sliding_window": pick([0, 0, 7, 40])}
        if seed % 2 == 0:
            kwargs["sinks"] = scenarios.random_sinks(kv_heads * group, seed=seed)
        num_tokens = len(lens)
        if seed % 3 == 0:  # multi-token rows
            q_lens = [int(torch.randint(1, n + 1, (1,), generator=rng)) for n in lens]
            kwargs["query_start_loc"] = query_start_loc(q_lens)
            num_tokens = sum(q_lens)
        query = random_query(num_tokens, kv_heads * group, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, **kwargs)


def test_reference_sinks_equal_gpt_oss_eager():
    """The reference's sinks are GPT-OSS's (transformers' eager attention: the sink
    concatenated as a last column of the logits, softmax, the column dropped)."""
    num_heads, num_kv_heads, head_size, n = 8, 2, 64, 37
    case = make_case([n], num_kv_heads, head_size, 16, torch.float32, poison=None)
    query = random_query(n, num_heads, head_size, torch.float32)
    sinks = scenarios.random_sinks(num_heads)
    got = ref.attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        0.125, query_start_loc=query_start_loc([n]), sliding_window=9, sinks=sinks)

    def dense(cache):  # [heads, n, head_size] in token order, each KV head repeated per group
        rows = cache[case.block_tables[0, :-(-n // 16)].long()].permute(1, 0, 2, 3).reshape(
            num_kv_heads, -1, head_size)[:, :n]
        return rows.repeat_interleave(num_heads // num_kv_heads, dim=0)

    logits = 0.125 * query.transpose(0, 1) @ dense(case.key_cache).transpose(1, 2)
    pos = torch.arange(n)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 9)
    logits = logits.masked_fill(~visible, float("-inf"))
    combined = torch.cat([logits, sinks.reshape(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    want = (probs @ dense(case.value_cache)).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
