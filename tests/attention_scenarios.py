"""paged.attention scenarios run on every backend: tests/test_attention.py runs them on the
CPU, tests/test_cuda.py on a GPU. Each scenario builds its inputs on the CPU, runs the op
on the given device and checks the result against the fp32 reference on the CPU.

Plain functions and parameter grids (no pytest), so test_cuda.py can also run them as a
script on a machine without pytest.

KV formats: :class:`KVFormat` names a cache dtype (fp8 with per-layer or
per-head scales; the per-token int8 and int4 formats with their scale tensors) and a layout
(HND, NHD, a view into a joint K/V tensor, padded rows; the per-token scales in the same
layout); :func:`with_format` turns a float HND case into it. The kv_format_* and
token_format_* scenarios sample the formats across the adversarial cases; quantized
results are checked against a float64 reference computed from the dequantized cache.
"""

import dataclasses
import itertools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_attention_ext import token_quantization
from paged_attention_ext.quantization import FP8_DTYPES
from paged_attention_ext.token_quantization import TOKEN_DTYPES
from paged_case import (DTYPES, TOLERANCES, PagedCase, free_out_of_window, make_case, query_start_loc,
                        random_query)

Scenario = Callable[..., None]
_REGISTRY: List[Tuple[Scenario, Dict[str, Sequence]]] = []


def scenario(**grid: Sequence) -> Callable[[Scenario], Scenario]:
    """Registers a scenario ``fn(device, **params)`` to run once per point of ``grid``."""
    def register(fn: Scenario) -> Scenario:
        _REGISTRY.append((fn, grid))
        return fn
    return register


@dataclasses.dataclass(frozen=True)
class ScenarioCase:
    """One scenario at one point of its grid."""

    fn: Scenario
    params: Tuple[Tuple[str, object], ...]

    def run(self, device: str) -> None:
        self.fn(device, **dict(self.params))

    def __str__(self) -> str:
        values = "-".join(str(v).replace("torch.", "") for _, v in self.params)
        return self.fn.__name__ + (f"[{values}]" if values else "")


def scenario_cases() -> List[ScenarioCase]:
    """Every registered scenario at every point of its grid."""
    cases = []
    for fn, grid in _REGISTRY:
        names = list(grid)
        for values in itertools.product(*(grid[n] for n in names)):
            cases.append(ScenarioCase(fn, tuple(zip(names, values))))
    return cases


# ---- running the op on a device -------------------------------------------------------

def strided_to(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device`` with the same strides (``.to`` would make a padded view dense)."""
    if t.device == torch.device(device) or t.is_contiguous():
        return t.to(device)
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).to(device)
    return torch.as_strided(flat, t.shape, t.stride(), 0)


def on_device(case: PagedCase, device: str) -> PagedCase:
    """``case`` with its tensors on ``device`` (the same tensors when already there); cache
    views keep their strides."""
    return dataclasses.replace(case, key_cache=strided_to(case.key_cache, device),
                               value_cache=strided_to(case.value_cache, device),
                               block_tables=case.block_tables.to(device),
                               seq_lens=case.seq_lens.to(device))


def attention_with_lse(device: str, query: torch.Tensor, case: PagedCase, scale: float,
                       **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """paged.attention_with_lse on ``device``; outputs back on the CPU."""
    dev = on_device(case, device)
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out, lse = pa.attention_with_lse(query.to(device), dev.key_cache, dev.value_cache, dev.block_tables,
                                     dev.seq_lens, scale, **moved)
    return out.cpu(), lse.cpu()


def assert_matches_reference(device: str, query: torch.Tensor, case: PagedCase, scale: float,
                             **kwargs) -> torch.Tensor:
    """The op against the reference: fp32 for float caches; for fp8 caches (kwargs with
    k_scale / v_scale) float64 from the dequantized cache, which the op must match to fp32
    rounding (then the output dtype's)."""
    out, lse = attention_with_lse(device, query, case, scale, **kwargs)
    oracle_query = query.double() if quantized(case.key_cache.dtype) else query
    want, want_lse = ref.attention_with_lse(oracle_query, case.key_cache, case.value_cache,
                                            case.block_tables, case.seq_lens, scale, **kwargs)
    want, want_lse = want.to(query.dtype), want_lse.float()
    assert out.dtype == query.dtype
    head_size_v = token_quantization.head_size_of(case.value_cache)
    assert out.shape == query.shape[:2] + (head_size_v,), "out has the value head size"
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[query.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    return out


def quantized(dtype: torch.dtype) -> bool:
    """fp8 and per-token caches: checked against the float64 reference."""
    return dtype in FP8_DTYPES + TOKEN_DTYPES


def edge_lengths(block_size: int) -> List[int]:
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 5})


def random_sinks(num_heads: int, seed: int = 2) -> torch.Tensor:
    """fp32 sinks of the size of the scores, so they visibly change every row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_heads, generator=gen) * 2.0


def alibi(num_heads: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)],
                        dtype=torch.float32)


# ---- KV formats: fp8 caches and strided layouts ---------------------------------------------

# HND: contiguous. NHD: [blocks, block_size, heads, head] transposed. joint: vLLM's
# kv[2, blocks, block_size, heads, max head size] (K and V heads sliced when they differ).
# padded: one spare row per block and 8 spare lanes per row. odd: rows hs + 1 apart
# (unaligned rows; the CPU tests use it, a GPU kernel may refuse it).
LAYOUTS = ("HND", "NHD", "joint", "padded", "odd")


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """A cache dtype (None: the scenario's float dtype) with its scales, and a layout."""

    cache_dtype: Optional[torch.dtype] = None
    per_head_scales: bool = False
    layout: str = "HND"

    def __str__(self) -> str:
        if self.cache_dtype is None:
            return self.layout
        if self.cache_dtype in TOKEN_DTYPES:
            return f"{'int8' if self.cache_dtype == torch.int8 else 'int4'}-token-{self.layout}"
        fmt = str(self.cache_dtype).replace("torch.float8_", "")
        return f"{fmt}-{'head' if self.per_head_scales else 'layer'}-{self.layout}"


HND = KVFormat()
# Every fp8 format and scale kind in every shared layout, and the float layouts.
FP8_FORMATS = [KVFormat(d, per_head, layout) for layout in LAYOUTS[:4] for d in FP8_DTYPES
               for per_head in (False, True)]
FLOAT_LAYOUTS = [KVFormat(layout=layout) for layout in LAYOUTS[1:4]]
# The per-token formats (int8; uint8: int4) in every shared layout, scales laid out alike.
TOKEN_FORMATS = [KVFormat(d, layout=layout) for layout in LAYOUTS[:4] for d in TOKEN_DTYPES]


def fp8_scales(cache: torch.Tensor, used: torch.Tensor, dtype: torch.dtype,
               per_head: bool) -> torch.Tensor:
    """Scales that map the used slots' largest magnitude to about half the format's range
    (per head: each head's own, times 1 + h / 2, so every head's scale differs)."""
    rows = cache.permute(0, 2, 1, 3)[used].float()  # [used slots, heads, head size]
    amax = rows.abs().amax(dim=(0, 2)).clamp_min(1e-3)
    target = torch.finfo(dtype).max / 2
    if not per_head:
        return (amax.max() / target).reshape(())
    return amax / target * (1 + torch.arange(cache.shape[1]) / 2)


def _filled(shape, dtype: torch.dtype) -> torch.Tensor:
    """A NaN-filled buffer (the padding of strided layouts must never be read; per-token
    rows: the largest code, their scales NaN)."""
    if dtype in FP8_DTYPES:
        return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)  # NaN in both formats
    if dtype in TOKEN_DTYPES:
        return torch.full(shape, 127, dtype=dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def relayout_scales(k_scale: torch.Tensor, v_scale: torch.Tensor,
                    layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales [blocks, heads, block_size(, 2)] in the layout of their caches
    (relayout): NHD, one joint tensor, a spare NaN row per block."""
    if layout == "HND":
        return k_scale, v_scale
    if layout == "joint":
        both = torch.stack((k_scale, v_scale)).transpose(2, 3).contiguous()
        return both[0].transpose(1, 2), both[1].transpose(1, 2)

    def one(scale: torch.Tensor) -> torch.Tensor:
        if layout == "NHD":
            return scale.transpose(1, 2).contiguous().transpose(1, 2)
        nb, kvh, bs = scale.shape[:3]
        buf = torch.full((nb, kvh, bs + 1) + scale.shape[3:], float("nan"))
        buf[:, :, :bs] = scale
        return buf[:, :, :bs]

    return one(k_scale), one(v_scale)


def relayout(key_cache: torch.Tensor, value_cache: torch.Tensor,
             layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Contiguous HND caches copied into ``layout``, returned as HND-shaped views."""
    if layout == "HND":
        return key_cache, value_cache
    if layout == "joint":
        nb, kvh, bs, hs = key_cache.shape
        hsv = value_cache.shape[3]
        kv = _filled((2, nb, bs, kvh, max(hs, hsv)), key_cache.dtype)
        kv[0, ..., :hs] = key_cache.transpose(1, 2)
        kv[1, ..., :hsv] = value_cache.transpose(1, 2)
        return kv[0, ..., :hs].transpose(1, 2), kv[1, ..., :hsv].transpose(1, 2)

    def one(cache: torch.Tensor) -> torch.Tensor:
        nb, kvh, bs, hs = cache.shape
        if layout == "NHD":
            return cache.transpose(1, 2).contiguous().transpose(1, 2)
        extra_rows, extra_lanes = {"padded": (1, 8), "odd": (0, 1)}[layout]
        buf = _filled((nb, kvh, bs + extra_rows, hs + extra_lanes), cache.dtype)
        buf[:, :, :bs, :hs] = cache
        return buf[:, :, :bs, :hs]

    return one(key_cache), one(value_cache)


def with_format(case: PagedCase, fmt: KVFormat) -> Tuple[PagedCase, Dict[str, torch.Tensor]]:
    """``case`` (float, HND) in ``fmt``, and the op's extra arguments (the fp8 scales).
    Poisoned unused slots stay poisoned: NaN quantizes to NaN, huge values saturate."""
    key_cache, value_cache = case.key_cache, case.value_cache
    extra: Dict[str, torch.Tensor] = {}
    if fmt.cache_dtype in TOKEN_DTYPES:
        # Each row quantized from its own values: NaN rows get NaN scales, huge ones huge.
        key_cache, k_scale = token_quantization.quantize(key_cache.float(), fmt.cache_dtype)
        value_cache, v_scale = token_quantization.quantize(value_cache.float(), fmt.cache_dtype)
        k_scale, v_scale = relayout_scales(k_scale, v_scale, fmt.layout)
        extra = {"k_scale": k_scale, "v_scale": v_scale}
    elif fmt.cache_dtype is not None:
        k_scale = fp8_scales(key_cache, case.used_slots, fmt.cache_dtype, fmt.per_head_scales)
        v_scale = fp8_scales(value_cache, case.used_slots, fmt.cache_dtype, fmt.per_head_scales)
        key_cache = ref.quantize(key_cache.transpose(1, 2), k_scale, fmt.cache_dtype).transpose(1, 2)
        value_cache = ref.quantize(value_cache.transpose(1, 2), v_scale, fmt.cache_dtype).transpose(1, 2)
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
        extra = {"k_scale": k_scale, "v_scale": v_scale}
    key_cache, value_cache = relayout(key_cache, value_cache, fmt.layout)
    return dataclasses.replace(case, key_cache=key_cache, value_cache=value_cache), extra


def poison_unused(case: PagedCase, value: float,
                  extra: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """PagedCase.poison_unused for any cache dtype and layout (fp8: ``value`` saturated;
    per-token: the largest codes, and ``value`` in their scales, ``extra``'s)."""
    if case.key_cache.dtype in TOKEN_DTYPES:
        for scale in extra.values():
            scale.transpose(1, 2)[~case.used_slots] = value
    for cache in (case.key_cache, case.value_cache):
        if cache.dtype in TOKEN_DTYPES:
            cache.permute(0, 2, 1, 3)[~case.used_slots] = 127
        elif cache.dtype in FP8_DTYPES:
            limit = torch.finfo(cache.dtype).max
            byte = torch.tensor(value).clamp(-limit, limit).to(cache.dtype).view(torch.uint8)
            cache.view(torch.uint8).permute(0, 2, 1, 3)[~case.used_slots] = byte
        else:
            cache.permute(0, 2, 1, 3)[~case.used_slots] = value


def sample_formats(formats: Sequence[KVFormat], count: int, offset: int) -> List[KVFormat]:
    """``count`` of ``formats`` from ``offset`` on, cyclically: the kv_format scenarios
    cover every format across their features without the full cross product."""
    return [formats[(offset + i) % len(formats)] for i in range(count)]


# ---- scenarios ----------------------------------------------------------------------------

@scenario(dtype=DTYPES, block_size=[1, 8, 16, 32, 64, 128, 256])
def decode_block_sizes_and_edge_lengths(device, dtype, block_size):
    lens = edge_lengths(block_size) + [0]  # 0: a padded row
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=block_size, dtype=dtype)
    out = assert_matches_reference(device, random_query(len(lens), 8, 64, dtype), case, 64 ** -0.5)
    assert (out[-1] == 0).all(), "a padded row must yield zeros"


@scenario(dtype=DTYPES, head_size=[8, 32, 40, 64, 80, 96, 112, 120, 128, 136, 192, 256, 264, 512])
def decode_head_sizes(device, dtype, head_size):
    lens = [1, 15, 16, 17, 70]
    case = make_case(lens, num_kv_heads=2, head_size=head_size, block_size=16, dtype=dtype)
    assert_matches_reference(device, random_query(len(lens), 4, head_size, dtype), case,
                             head_size ** -0.5)


@scenario(heads=[(4, 4), (8, 2), (16, 2), (8, 1), (12, 1), (40, 4), (64, 1)], multi_token=[False, True])
def gqa_and_mqa(device, heads, multi_token):
    # (query heads, KV heads). On CUDA, groups larger than a CTA's 8 query vectors are
    # split over several CTAs.
    num_heads, num_kv_heads = heads
    lens = [5, 33, 64, 100]
    q_lens = [5, 2, 1, 9] if multi_token else None
    case = make_case(lens, num_kv_heads=num_kv_heads, head_size=64, block_size=16, dtype=torch.float32)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(int(qsl[-1]) if multi_token else len(lens), num_heads, 64, torch.float32)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl)


@scenario(poison=[float("nan"), 1e30, -1e30, float("inf")])
def unused_slots_do_not_change_output(device, poison):
    lens = [1, 15, 16, 17, 0, 40]
    clean = make_case(lens, 2, 64, 16, torch.float32, poison=None)
    query = random_query(len(lens), 4, 64, torch.float32)
    before, _ = attention_with_lse(device, query, clean, 0.125)
    clean.poison_unused(poison)
    after, _ = attention_with_lse(device, query, clean, 0.125)
    assert torch.equal(before, after)


@scenario(dtype=DTYPES)
def multi_token_mixed_with_decode(device, dtype):
    # Prefill from empty, chunked prefill after a cached prefix, a decode row, speculative
    # decoding (3 tokens), a padded sequence and a long chunk, in one call.
    lens = [37, 80, 20, 19, 0, 300]
    q_lens = [37, 16, 1, 3, 0, 150]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    query = random_query(sum(q_lens), 8, 64, dtype)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=query_start_loc(q_lens))


@scenario(window=[1, 7, 16, 50, 700], multi_token=[False, True])
def sliding_window(device, window, multi_token):
    lens = [1, 16, 17, 90, 2000]
    q_lens = [1, 16, 5, 40, 33] if multi_token else None
    case = make_case(lens, 2, 64, 16, torch.float32)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 4, 64, torch.float32)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sliding_window=window)


@scenario(window=[1, 15, 16, 17, 100], multi_token=[False, True], dtype=DTYPES)
def sliding_window_freed_blocks(device, window, multi_token, dtype):
    # A block manager frees a sliding layer's blocks once no query can see them: their
    # entries are -1 or stale ids and their memory NaN, and the op must never read them.
    lens = [1, 15, 16, 17, 33, 300, 2000]
    q_lens = [1, 15, 3, 17, 2, 40, 33] if multi_token else None
    case = free_out_of_window(make_case(lens, 2, 64, 16, dtype), window, q_lens)
    assert case.freed > 0
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 8, 64, dtype)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sliding_window=window)


def feature_case(multi_token):
    """(case, query_start_loc, query): four bf16 sequences, GQA 8/2, for the feature scenarios."""
    lens = [3, 17, 64, 129]
    q_lens = [3, 4, 1, 20] if multi_token else None
    case = make_case(lens, 2, 64, 16, torch.bfloat16)
    qsl = query_start_loc(q_lens) if multi_token else None
    return case, qsl, random_query(sum(q_lens) if multi_token else len(lens), 8, 64, torch.bfloat16)


@scenario(multi_token=[False, True])
def alibi_and_soft_cap(device, multi_token):
    case, qsl, query = feature_case(multi_token)
    slopes = alibi(8)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, alibi_slopes=slopes)
    assert_matches_reference(device, query * 8, case, 0.125, query_start_loc=qsl, soft_cap=5.0)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, alibi_slopes=slopes,
                             sliding_window=10, soft_cap=30.0)


@scenario(dtype=[torch.float32, torch.bfloat16])
def split_kv_long_context(device, dtype):
    # Few sequences with long contexts: the keys are split into partitions and merged.
    lens = [20000, 777, 0]
    case = make_case(lens, 1, 128, 16, dtype)
    query = random_query(len(lens), 4, 128, dtype)
    assert_matches_reference(device, query, case, 128 ** -0.5)
    assert_matches_reference(device, query, case, 128 ** -0.5, sliding_window=1500)
    qsl = query_start_loc([40, 3, 0])
    query = random_query(43, 4, 128, dtype)
    assert_matches_reference(device, query, case, 128 ** -0.5, query_start_loc=qsl)


@scenario()
def large_scores_are_stable(device):
    case = make_case([50, 3], 1, 64, 16, torch.float32)
    query = random_query(2, 2, 64, torch.float32) * 100.0
    assert assert_matches_reference(device, query, case, 1.0).isfinite().all()


@scenario()
def non_contiguous_query_and_lse_of_one_key(device):
    case = make_case([10, 33], 2, 64, 8, torch.float32)
    fused = random_query(2, 12, 64, torch.float32).to(device)
    query = fused[:, :8]  # a view into a fused projection: strided heads
    assert not query.is_contiguous()
    dev = on_device(case, device)
    out = pa.attention(query, dev.key_cache, dev.value_cache, dev.block_tables, dev.seq_lens, 0.125)
    want = ref.attention(query.cpu(), case.key_cache, case.value_cache, case.block_tables,
                         case.seq_lens, 0.125)
    torch.testing.assert_close(out.cpu(), want, **TOLERANCES[torch.float32])
    # The lse of a single visible key is exactly its score.
    one = make_case([1], 1, 64, 8, torch.float32)
    q = random_query(1, 1, 64, torch.float32)
    _, lse = attention_with_lse(device, q, one, 0.5)
    block = int(one.block_tables[0, 0])
    torch.testing.assert_close(lse[0, 0], 0.5 * torch.dot(q[0, 0], one.key_cache[block, 0, 0]))


@scenario()
def lse_merges_two_halves_exactly(device):
    # Attention over keys [0, n) equals the LSE-weighted merge of [0, m) and [m, n).
    n, m = 1000, 370
    case = make_case([n], 1, 64, 16, torch.float32)
    q = random_query(1, 4, 64, torch.float32)
    full, _ = attention_with_lse(device, q, case, 0.125)
    # Keys [0, m): the same table with seq_len m (the query, placed at m-1, sees them all).
    first_half = dataclasses.replace(case, seq_lens=torch.tensor([m], dtype=torch.int32))
    first, lse1 = attention_with_lse(device, q, first_half, 0.125)
    # Keys [m, n): the query at n-1 with a window of n - m.
    second, lse2 = attention_with_lse(device, q, case, 0.125, sliding_window=n - m)
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    merged = (first * w1[..., None] + second * w2[..., None]) / (w1 + w2)[..., None]
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


@scenario()
def out_variant_writes_into_caller_buffers(device):
    case = make_case([5, 0, 40], 2, 64, 16, torch.bfloat16)
    query = random_query(3, 4, 64, torch.bfloat16)
    dev = on_device(case, device)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((3, 4), float("nan"), device=device)
    result = pa.attention_out(out, query.to(device), dev.key_cache, dev.value_cache, dev.block_tables,
                              dev.seq_lens, 0.125, lse=lse)
    assert result.data_ptr() == out.data_ptr()
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                            case.seq_lens, 0.125)
    torch.testing.assert_close(out.cpu().float(), want.float(), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse.cpu(), want_lse)
    assert (out[1] == 0).all() and math.isinf(lse[1, 0]) and lse[1, 0] < 0


# ---- attention sinks ------------------------------------------------------------------------

@scenario(dtype=DTYPES, heads=[(8, 8), (8, 2), (16, 1)], multi_token=[False, True])
def sinks_mha_gqa_mqa(device, dtype, heads, multi_token):
    # MHA, GQA and MQA; decode rows, prefill, chunked prefill and a padded sequence.
    num_heads, num_kv_heads = heads
    lens = [1, 15, 16, 17, 0, 100]
    q_lens = [1, 4, 16, 2, 0, 33] if multi_token else None
    case = make_case(lens, num_kv_heads, 64, 16, dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), num_heads, 64, dtype)
    sinks = random_sinks(num_heads)
    out = assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sinks=sinks)
    without, _ = attention_with_lse(device, query, case, 0.125, query_start_loc=qsl)
    assert not torch.allclose(out.float(), without.float()), "the sinks changed nothing"
    if not multi_token:
        # The padded row sees no key: output 0, lse the sink.
        _, lse = attention_with_lse(device, query, case, 0.125, sinks=sinks)
        assert (out[4] == 0).all() and torch.equal(lse[4], sinks)


@scenario(multi_token=[False, True])
def sinks_with_window_soft_cap_and_alibi(device, multi_token):
    case, qsl, query = feature_case(multi_token)
    sinks = random_sinks(8)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sinks=sinks,
                             sliding_window=10)
    assert_matches_reference(device, query * 8, case, 0.125, query_start_loc=qsl, sinks=sinks,
                             soft_cap=5.0)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sinks=sinks,
                             alibi_slopes=alibi(8), sliding_window=10, soft_cap=30.0)


@scenario()
def extreme_sinks(device):
    # Per head: sinks that swamp every score (output 0, lse the sink), sinks no score
    # notices (as if there were none), 0, and -inf (exactly no sink).
    lens = [1, 40, 0, 300]
    case = make_case(lens, 2, 64, 16, torch.float32)
    query = random_query(4, 8, 64, torch.float32)
    sinks = torch.tensor([1e30, -1e30, float("-inf"), 0.0, 60.0, -60.0, 1e4, -1e4])
    out = assert_matches_reference(device, query, case, 0.125, sinks=sinks)
    _, lse = attention_with_lse(device, query, case, 0.125, sinks=sinks)
    plain, plain_lse = attention_with_lse(device, query, case, 0.125)
    for h in (0, 4, 6):  # swamped
        assert out[:, h].abs().max() < 1e-20 and torch.equal(lse[:, h], sinks[h].expand(4))
    for h in (1, 2, 5, 7):  # unnoticed by rows that see a key
        seen = [0, 1, 3]
        torch.testing.assert_close(out[seen, h], plain[seen, h])
        torch.testing.assert_close(lse[seen, h], plain_lse[seen, h])
    assert torch.equal(lse[2], sinks), "a row that sees no key has the sink as its lse"


@scenario(dtype=[torch.float32, torch.bfloat16])
def sinks_split_kv_long_context(device, dtype):
    # Partitions merged by their lse: the sink must count exactly once. Sinks near the
    # lse of 20000 keys (about 10) matter.
    lens = [20000, 777, 0]
    case = make_case(lens, 1, 128, 16, dtype)
    query = random_query(len(lens), 4, 128, dtype)
    sinks = torch.tensor([10.0, -3.0, 8.0, 12.0])
    assert_matches_reference(device, query, case, 128 ** -0.5, sinks=sinks)
    assert_matches_reference(device, query, case, 128 ** -0.5, sinks=sinks, sliding_window=1500)
    qsl = query_start_loc([40, 3, 0])
    query = random_query(43, 4, 128, dtype)
    assert_matches_reference(device, query, case, 128 ** -0.5, query_start_loc=qsl, sinks=sinks)


# ---- value head size != key head size (MLA as transformers runs it) -----------------------

@scenario(dtype=DTYPES, head_sizes=[(192, 128), (96, 64), (64, 128), (128, 64), (80, 64),
                                    (64, 80), (40, 128), (256, 8), (576, 512), (512, 64)])
def value_head_size_differs(device, dtype, head_sizes):
    # Whole-vector, ragged and mixed rows (80 is not a whole number of AVX-512 vectors,
    # nor 40 of any), with every feature.
    head_size, head_size_v = head_sizes
    lens = [1, 15, 16, 17, 0, 70]
    case = make_case(lens, 2, head_size, 16, dtype, head_size_v=head_size_v)
    scale = head_size ** -0.5
    out = assert_matches_reference(device, random_query(len(lens), 8, head_size, dtype), case, scale)
    assert (out[4] == 0).all(), "a padded row must yield zeros"
    q_lens = [1, 3, 16, 17, 0, 40]
    query = random_query(sum(q_lens), 8, head_size, dtype)
    assert_matches_reference(device, query, case, scale, query_start_loc=query_start_loc(q_lens),
                             alibi_slopes=alibi(8), sliding_window=20, soft_cap=30.0,
                             sinks=random_sinks(8))


def latent_case(lens: Sequence[int], block_size: int, cache_dtype: torch.dtype,
                fp8: Optional[torch.dtype] = None, seed: int = 0) -> Tuple[PagedCase, Dict[str, torch.Tensor]]:
    """An MLA latent cache: one 576-wide row per token on one KV head, the keys the whole
    row and the values its leading 512 columns, a view of the same memory (never a copy);
    with ``fp8``, quantized with one scale (the op's k_scale and v_scale). Per-token: int8
    rows and their scales serve as both too; int4 rows are rotated whole, so the values
    are rows of their own (the leading 512 columns quantized apart)."""
    case = make_case(lens, 1, 576, block_size, torch.float32, head_size_v=8, seed=seed)
    key, extra = case.key_cache.to(cache_dtype), {}
    if fp8 == torch.uint8:
        key, k_scale = token_quantization.quantize(case.key_cache, fp8)
        value, v_scale = token_quantization.quantize(case.key_cache[..., :512], fp8)
        case.key_cache, case.value_cache = key, value
        return case, {"k_scale": k_scale, "v_scale": v_scale}
    if fp8 == torch.int8:
        key, scale = token_quantization.quantize(case.key_cache, fp8)
        extra = {"k_scale": scale, "v_scale": scale}
    elif fp8 is not None:
        scale = fp8_scales(case.key_cache, case.used_slots, fp8, per_head=False)
        key = ref.quantize(case.key_cache.transpose(1, 2), scale, fp8).transpose(1, 2).contiguous()
        extra = {"k_scale": scale, "v_scale": scale}
    case.key_cache, case.value_cache = key, key[..., :512]
    return case, extra


@scenario(dtype=DTYPES, multi_token=[False, True], block_size=[16, 64])
def mla_latent_rows(device, dtype, multi_token, block_size):
    # DeepSeek-V3's absorbed attention over its latent cache: 16 query heads (a tensor-parallel
    # rank's share of 128) on the one latent head, scaled by 192 ** -0.5; long rows split.
    lens = [1, block_size - 1, block_size + 1, 700, 0]
    q_lens = [1, 3, block_size + 1, 20, 0] if multi_token else None
    case, _ = latent_case(lens, block_size, dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 16, 576, dtype)
    assert_matches_reference(device, query, case, 192 ** -0.5, query_start_loc=qsl,
                             sinks=random_sinks(16))


@scenario(dtype=DTYPES, multi_token=[False, True], block_size=[16, 64])
def deepseek_v3_mla_shapes(device, dtype, multi_token, block_size):
    # DeepSeek-V3 attention as transformers runs it: MHA after the up-projections, key head
    # 192 (128 no-RoPE + 64 RoPE), value head 128, scaled by 192 ** -0.5.
    lens = [1, block_size - 1, block_size + 1, 300, 0]
    q_lens = [1, 3, block_size + 1, 50, 0] if multi_token else None
    case = make_case(lens, 16, 192, block_size, dtype, head_size_v=128)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 16, 192, dtype)
    assert_matches_reference(device, query, case, 192 ** -0.5, query_start_loc=qsl)


@scenario(dtype=[torch.float32, torch.bfloat16])
def value_head_size_split_kv_long_context(device, dtype):
    lens = [6000, 33]
    case = make_case(lens, 1, 192, 16, dtype, head_size_v=128)
    query = random_query(len(lens), 4, 192, dtype)
    assert_matches_reference(device, query, case, 192 ** -0.5)
    assert_matches_reference(device, query, case, 192 ** -0.5, sinks=random_sinks(4))


@scenario()
def out_variant_with_sinks_and_value_head_size(device):
    case = make_case([5, 0, 40], 2, 96, 16, torch.bfloat16, head_size_v=64)
    query = random_query(3, 4, 96, torch.bfloat16)
    sinks = random_sinks(4)
    dev = on_device(case, device)
    out = torch.full((3, 4, 64), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((3, 4), float("nan"), device=device)
    pa.attention_out(out, query.to(device), dev.key_cache, dev.value_cache, dev.block_tables,
                     dev.seq_lens, 0.125, lse=lse, sinks=sinks.to(device))
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                            case.seq_lens, 0.125, sinks=sinks)
    torch.testing.assert_close(out.cpu().float(), want.float(), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse.cpu(), want_lse)
    assert (out[1] == 0).all() and torch.equal(lse[1].cpu(), sinks)


# ---- KV formats (fp8 caches, strided layouts) across the adversarial cases ------------------

ALL_FORMATS = FP8_FORMATS + FLOAT_LAYOUTS


@scenario(kv=ALL_FORMATS, block_size=[1, 16, 32])
def kv_format_edge_lengths(device, kv, block_size):
    # Random block order, lengths 1, bs-1, bs, bs+1, a padded row, NaN in unused slots;
    # fp8 formats take a query of each float dtype in turn.
    lens = edge_lengths(block_size) + [0]
    dtype = DTYPES[(ALL_FORMATS.index(kv) + block_size) % 3] if kv.cache_dtype else torch.bfloat16
    case, extra = with_format(make_case(lens, 2, 64, block_size, dtype=torch.float32 if kv.cache_dtype
                                        else dtype), kv)
    out = assert_matches_reference(device, random_query(len(lens), 8, 64, dtype), case, 0.125, **extra)
    assert (out[-1] == 0).all(), "a padded row must yield zeros"


def _feature_gqa_multi_token(device, case_of, dtype):
    lens, q_lens = [5, 33, 64, 100], [5, 2, 1, 9]
    case, extra = case_of(make_case(lens, 2, 64, 16, torch.float32))
    qsl = query_start_loc(q_lens)
    query = random_query(int(qsl[-1]), 16, 64, dtype)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, **extra)


def _feature_head_sizes(device, case_of, dtype):
    # 128 (its own compile), a ragged size (80) and differing K/V head sizes (192/128, 40/128).
    lens = [1, 15, 16, 17, 0, 70]
    for head_size, head_size_v in ((128, 128), (80, 80), (192, 128), (40, 128)):
        case, extra = case_of(make_case(lens, 2, head_size, 16, torch.float32, head_size_v=head_size_v))
        query = random_query(len(lens), 4, head_size, dtype)
        assert_matches_reference(device, query, case, head_size ** -0.5, **extra)


def _feature_window_alibi_soft_cap(device, case_of, dtype):
    lens, q_lens = [1, 16, 17, 90, 300], [1, 16, 5, 40, 33]
    case, extra = case_of(make_case(lens, 2, 64, 16, torch.float32))
    qsl = query_start_loc(q_lens)
    query = random_query(sum(q_lens), 8, 64, dtype)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, sliding_window=7, **extra)
    assert_matches_reference(device, query, case, 0.125, query_start_loc=qsl, alibi_slopes=alibi(8),
                             soft_cap=5.0, **extra)


def _feature_sinks_and_lse(device, case_of, dtype):
    lens = [1, 15, 16, 17, 0, 100]
    case, extra = case_of(make_case(lens, 1, 64, 16, torch.float32))
    query = random_query(len(lens), 8, 64, dtype)
    sinks = random_sinks(8)
    assert_matches_reference(device, query, case, 0.125, sinks=sinks, **extra)
    _, lse = attention_with_lse(device, query, case, 0.125, sinks=sinks, **extra)
    assert torch.equal(lse[4], sinks), "a padded row's lse is its sink"


def _feature_split_kv_long_context(device, case_of, dtype):
    lens = [5000, 777, 0]
    case, extra = case_of(make_case(lens, 2, 128, 16, torch.float32))
    query = random_query(len(lens), 8, 128, dtype)
    assert_matches_reference(device, query, case, 128 ** -0.5, sinks=random_sinks(8), **extra)
    qsl = query_start_loc([40, 3, 0])
    query = random_query(43, 8, 128, dtype)
    assert_matches_reference(device, query, case, 128 ** -0.5, query_start_loc=qsl,
                             sliding_window=1500, **extra)


def _feature_mha_block_size_1(device, case_of, dtype):
    lens = [1, 2, 3, 40]
    case, extra = case_of(make_case(lens, 4, 64, 1, torch.float32))
    query = random_query(len(lens), 4, 64, dtype)
    assert_matches_reference(device, query, case, 0.125, **extra)


KV_FEATURES = {
    "gqa_multi_token": _feature_gqa_multi_token,
    "head_sizes": _feature_head_sizes,
    "window_alibi_soft_cap": _feature_window_alibi_soft_cap,
    "sinks_and_lse": _feature_sinks_and_lse,
    "split_kv_long_context": _feature_split_kv_long_context,
    "mha_block_size_1": _feature_mha_block_size_1,
}


@scenario(feature=list(KV_FEATURES), sample=range(4))
def kv_format_features(device, feature, sample):
    # Each feature in 4 formats, rotating through ALL_FORMATS so that every format meets
    # several features; the query dtype rotates too.
    offset = 4 * list(KV_FEATURES).index(feature) + sample
    kv = sample_formats(ALL_FORMATS, 1, offset)[0]
    dtype = DTYPES[offset % 3]
    if kv.cache_dtype is None:  # float layouts: the cache has the query's dtype
        def case_of(case):
            as_dtype = dataclasses.replace(case, key_cache=case.key_cache.to(dtype),
                                           value_cache=case.value_cache.to(dtype))
            return with_format(as_dtype, kv)
    else:
        def case_of(case):
            return with_format(case, kv)
    KV_FEATURES[feature](device, case_of, dtype)


@scenario(kv=sample_formats(ALL_FORMATS, 6, 3), poison=[float("nan"), 1e30])
def kv_format_unused_slots_do_not_change_output(device, kv, poison):
    lens = [1, 15, 16, 17, 0, 40]
    case, extra = with_format(make_case(lens, 2, 64, 16, torch.float32, poison=None), kv)
    query = random_query(len(lens), 4, 64, torch.float32)
    before, _ = attention_with_lse(device, query, case, 0.125, **extra)
    poison_unused(case, poison)
    after, _ = attention_with_lse(device, query, case, 0.125, **extra)
    assert torch.equal(before, after)


# ---- per-token int8 / int4 caches across the adversarial cases ------------------------------

@scenario(kv=TOKEN_FORMATS, block_size=[1, 16, 32, 256])
def token_format_edge_lengths(device, kv, block_size):
    # Random block order, lengths 1, bs-1, bs, bs+1, a padded row, NaN rows (so NaN scales)
    # in unused slots; a query of each float dtype in turn.
    lens = edge_lengths(block_size) + [0]
    dtype = DTYPES[(TOKEN_FORMATS.index(kv) + block_size) % 3]
    case, extra = with_format(make_case(lens, 2, 64, block_size, torch.float32), kv)
    out = assert_matches_reference(device, random_query(len(lens), 8, 64, dtype), case, 0.125, **extra)
    assert (out[-1] == 0).all(), "a padded row must yield zeros"


@scenario(feature=list(KV_FEATURES), sample=range(4))
def token_format_features(device, feature, sample):
    # Each feature in 4 per-token formats (int8 and int4 in each), the query dtype rotating.
    offset = 4 * list(KV_FEATURES).index(feature) + sample
    kv = sample_formats(TOKEN_FORMATS, 1, offset)[0]
    KV_FEATURES[feature](device, lambda case: with_format(case, kv), DTYPES[offset % 3])


@scenario(cache_dtype=TOKEN_DTYPES, head_size=[96, 256, 512], multi_token=[False, True])
def token_format_head_sizes(device, cache_dtype, head_size, multi_token):
    # Head sizes up to Gemma-4's 512 (int4: rotation blocks of 32, 256 and 512 channels),
    # GQA 4:1, sinks and soft cap.
    lens, q_lens = [1, 15, 16, 17, 100, 0], [1, 3, 16, 17, 40, 0]
    case, extra = with_format(make_case(lens, 2, head_size, 16, torch.float32),
                              KVFormat(cache_dtype, layout="NHD" if multi_token else "HND"))
    qsl = query_start_loc(q_lens) if multi_token else None
    dtype = DTYPES[head_size % 3]
    query = random_query(sum(q_lens) if multi_token else len(lens), 8, head_size, dtype)
    assert_matches_reference(device, query, case, head_size ** -0.5, query_start_loc=qsl,
                             soft_cap=30.0, sinks=random_sinks(8), **extra)


@scenario(cache_dtype=TOKEN_DTYPES, multi_token=[False, True])
def token_format_mla_latent_rows(device, cache_dtype, multi_token):
    lens = [1, 15, 17, 300, 0]
    q_lens = [1, 3, 17, 20, 0] if multi_token else None
    case, extra = latent_case(lens, 16, torch.float32, cache_dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 16, 576, torch.bfloat16)
    assert_matches_reference(device, query, case, 192 ** -0.5, query_start_loc=qsl,
                             sinks=random_sinks(16), **extra)


@scenario(kv=TOKEN_FORMATS, poison=[float("nan"), 1e30])
def token_format_unused_slots_do_not_change_output(device, kv, poison):
    # Unused slots' rows at the largest code and their scales NaN or huge.
    lens = [1, 15, 16, 17, 0, 40]
    case, extra = with_format(make_case(lens, 2, 64, 16, torch.float32, poison=None), kv)
    query = random_query(len(lens), 4, 64, torch.float32)
    before, _ = attention_with_lse(device, query, case, 0.125, **extra)
    poison_unused(case, poison, extra)
    after, _ = attention_with_lse(device, query, case, 0.125, **extra)
    assert torch.equal(before, after)


# ---- shared prefixes (cascade attention) ------------------------------------------------------

@dataclasses.dataclass
class SharedPrefixCase:
    """Groups of sequences over one cache: group ``g``'s prefix is row ``g`` of
    ``prefixes`` (``prefixes.seq_lens[g]`` tokens); sequence ``i`` of the batch (rows of
    ``whole``) is its group's prefix blocks followed by blocks of its own, in random
    physical order, every unused slot NaN."""

    whole: PagedCase
    prefixes: PagedCase          # block_tables / seq_lens: one row per group
    group_of: List[int]          # the group of each sequence
    suffix_lens: List[int]

    @property
    def group_starts(self) -> torch.Tensor:
        """query_start_loc of the groups for one decode row per sequence."""
        counts = [self.group_of.count(g) for g in range(len(self.prefixes.seq_lens))]
        return query_start_loc(counts)

    def suffix_tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's own blocks and lengths (its table after the prefix blocks)."""
        bs = self.whole.block_size
        tables = torch.full_like(self.whole.block_tables, 1 << 30)
        for i, g in enumerate(self.group_of):
            skip = int(self.prefixes.seq_lens[g]) // bs
            tables[i, :tables.shape[1] - skip] = self.whole.block_tables[i, skip:]
        return tables, torch.tensor(self.suffix_lens, dtype=torch.int32)


def shared_prefix_case(prefix_lens: Sequence[int], group_sizes: Sequence[int],
                       suffix_lens: Sequence[int], num_kv_heads: int, head_size: int,
                       block_size: int, dtype: torch.dtype, seed: int = 0) -> SharedPrefixCase:
    """Sequences grouped in order (``group_sizes``), each with its suffix length. A prefix
    that ends inside a block is only used by the shared-prefix op alone (a suffix table
    starts on a block boundary)."""
    group_of = [g for g, n in enumerate(group_sizes) for _ in range(n)]
    assert len(group_of) == len(suffix_lens)
    base = make_case(list(prefix_lens) + list(suffix_lens), num_kv_heads, head_size, block_size,
                     dtype, seed=seed)
    num_groups = len(prefix_lens)
    width = base.block_tables.shape[1] * 2
    tables = torch.full((len(group_of), width), 1 << 30, dtype=torch.int32)
    lens = []
    for i, g in enumerate(group_of):
        prefix_blocks = -(-prefix_lens[g] // block_size)
        own_blocks = -(-suffix_lens[i] // block_size)
        row = torch.cat([base.block_tables[g, :prefix_blocks],
                         base.block_tables[num_groups + i, :own_blocks]])
        tables[i, :row.numel()] = row
        lens.append(prefix_lens[g] + suffix_lens[i])
    whole = dataclasses.replace(base, block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32))
    prefixes = dataclasses.replace(base, block_tables=base.block_tables[:num_groups].clone(),
                                   seq_lens=base.seq_lens[:num_groups].clone())
    return SharedPrefixCase(whole, prefixes, group_of, list(suffix_lens))


def shared_prefix_attention(device: str, query: torch.Tensor, case: PagedCase,
                            group_starts: torch.Tensor, scale: float, **kwargs):
    dev = on_device(case, device)
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out, lse = pa.shared_prefix_attention(query.to(device), dev.key_cache, dev.value_cache,
                                          dev.block_tables, dev.seq_lens, group_starts.to(device),
                                          scale, **moved)
    return out.cpu(), lse.cpu()


def assert_prefix_matches_reference(device: str, query: torch.Tensor, case: PagedCase,
                                    group_starts: torch.Tensor, scale: float, **kwargs) -> torch.Tensor:
    out, lse = shared_prefix_attention(device, query, case, group_starts, scale, **kwargs)
    oracle_query = query.double() if quantized(case.key_cache.dtype) else query
    want, want_lse = ref.shared_prefix_attention(oracle_query, case.key_cache, case.value_cache,
                                                 case.block_tables, case.seq_lens, group_starts,
                                                 scale, **kwargs)
    assert out.dtype == query.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[query.dtype])
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-5)
    return out


def cascade(device: str, query: torch.Tensor, case: SharedPrefixCase, scale: float,
            sinks: Optional[torch.Tensor] = None, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``case.whole`` as prefix op + suffix attention + merge."""
    prefix = shared_prefix_attention(device, query, case.prefixes, case.group_starts, scale,
                                     sinks=sinks, **kwargs)
    tables, lens = case.suffix_tables()
    suffix = attention_with_lse(device, query, dataclasses.replace(case.whole, block_tables=tables,
                                                                   seq_lens=lens), scale, **kwargs)
    out, lse = pa.merge_attention_states([prefix[0].to(device), suffix[0].to(device)],
                                         [prefix[1].to(device), suffix[1].to(device)])
    return out.cpu(), lse.cpu()


@scenario(dtype=DTYPES, block_size=[1, 16, 64], heads=[(8, 2), (4, 4)])
def shared_prefix_edge_lengths(device, dtype, block_size, heads):
    # Prefixes of 1, bs-1, bs, bs+1 and longer tokens, one of none; groups of 1 to 5 rows;
    # GQA and MHA; unused slots NaN. Then several rows per sequence (speculative rows).
    num_heads, num_kv_heads = heads
    prefix_lens = [1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 5, 0]
    sizes = [3, 1, 2, 5, 2, 2]
    case = shared_prefix_case(prefix_lens, sizes, [1] * sum(sizes), num_kv_heads, 64, block_size, dtype)
    query = random_query(sum(sizes), num_heads, 64, dtype)
    out = assert_prefix_matches_reference(device, query, case.prefixes, case.group_starts, 0.125)
    assert (out[-2:] == 0).all(), "a group without prefix sees nothing"
    starts = query_start_loc([s * 3 for s in sizes])
    query = random_query(int(starts[-1]), num_heads, 64, dtype, seed=3)
    assert_prefix_matches_reference(device, query, case.prefixes, starts, 0.125)


@scenario(dtype=DTYPES)
def shared_prefix_sinks_soft_cap_and_long_prefix(device, dtype):
    # A prefix long enough for split-KV partitions, sinks (counted once, in this op) and soft cap.
    case = shared_prefix_case([5000, 40], [8, 3], [1] * 11, 2, 128, 16, dtype)
    query = random_query(11, 8, 128, dtype)
    sinks = random_sinks(8)
    assert_prefix_matches_reference(device, query, case.prefixes, case.group_starts, 128 ** -0.5,
                                    sinks=sinks, soft_cap=3.0)


@scenario(fmt=FP8_FORMATS[:4] + FLOAT_LAYOUTS + TOKEN_FORMATS)
def shared_prefix_kv_formats(device, fmt):
    # fp8 caches (per-layer and per-head scales), per-token caches and strided layouts.
    case = shared_prefix_case([17, 33, 64], [2, 4, 1], [1] * 7, 2, 64, 16, torch.float32)
    prefixes, extra = with_format(case.prefixes, fmt)
    query = random_query(7, 8, 64, torch.bfloat16 if fmt.cache_dtype else torch.float32)
    assert_prefix_matches_reference(device, query, prefixes, case.group_starts, 0.125, **extra)


@scenario(dtype=DTYPES, block_size=[1, 16, 32], heads=[(8, 2), (32, 8), (4, 4)])
def cascade_equals_plain_attention(device, dtype, block_size, heads):
    # Prefix op + suffix attention + merge == attention over each whole sequence, with
    # suffixes of 0 (the query's position past the prefix), 1, bs - 1, bs and bs + 1 tokens.
    num_heads, num_kv_heads = heads
    bs = block_size
    suffixes = [0, 1, max(1, bs - 1), bs, bs + 1, 1, 7, 2 * bs + 3]
    case = shared_prefix_case([bs, 5 * bs, 2 * bs], [3, 4, 1], suffixes, num_kv_heads, 64, bs, dtype)
    query = random_query(len(suffixes), num_heads, 64, dtype)
    for sinks in (None, random_sinks(num_heads)):
        out, lse = cascade(device, query, case, 0.125, sinks=sinks)
        want, want_lse = ref.attention_with_lse(query, case.whole.key_cache, case.whole.value_cache,
                                                case.whole.block_tables, case.whole.seq_lens, 0.125,
                                                sinks=sinks)
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@scenario(dtype=DTYPES, parts=[1, 2, 5, 16])
def merge_attention_states_matches_reference(device, dtype, parts):
    # Strided outputs; parts that saw nothing (lse -inf, output NaN: never read); rows no
    # part saw; large lse differences.
    gen = torch.Generator().manual_seed(parts)
    outputs, lses = [], []
    for k in range(parts):
        wide = torch.randn(6, 4, 48 + 8 * k, generator=gen).to(dtype)
        out = wide[..., :48]
        lse = torch.randn(6, 4, generator=gen) * 30
        lse[k % 6, :2] = float("-inf")
        out[k % 6, :2] = float("nan")
        lse[5] = float("-inf")
        outputs.append(out)
        lses.append(lse)
    got, got_lse = pa.merge_attention_states([o.to(device) for o in outputs], [l.to(device) for l in lses])
    want, want_lse = ref.merge_attention_states(outputs, lses)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOLERANCES[dtype])
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)
    assert (got[5] == 0).all() and got_lse[5].isneginf().all()
