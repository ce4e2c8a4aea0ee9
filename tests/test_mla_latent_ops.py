"""The ops over an MLA latent cache, as an engine that keeps the latents drives them.

One cache ``[num_blocks, 1, block_size, 576]`` per layer holds each token's row: the KV
latent (512 columns) then the rotated key (64). The existing ops serve it through views of
that one tensor: ``write_kv`` stores the latent into ``cache[..., :512]`` and the rotated key
into ``cache[..., 512:]`` (vLLM's ``concat_and_cache_mla``), ``attention`` reads the whole
row as the key and ``cache[..., :512]`` as the value, ``copy_blocks`` moves both column
views, ``swap_blocks`` whole blocks. The absorbed attention must equal the expanded one.
"""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref

from latent_rows import LORA, ROPE, WIDTH, latent_cache, latent_case, rows_of

NOPE, V_HEAD, HEADS = 128, 128, 4
BLOCK_SIZE = 16


def write_through_views(latent, rotary_key, cache, slots, scale=None):
    """``paged.write_latent``'s rows (``[tokens, 1, 512]``, ``[tokens, 1, 64]``) stored as
    ``write_kv``'s keys and values into their column views of the slots' rows."""
    pa.write_kv(latent, rotary_key, cache[..., :LORA], cache[..., LORA:], slots, scale, scale)


def test_write_fills_each_row_with_both_latents():
    cache, _ = latent_cache(4, BLOCK_SIZE, torch.float32)  # NaN: a stray write shows
    gen = torch.Generator().manual_seed(0)
    kv_latent, rotated_key = torch.randn(5, LORA, generator=gen), torch.randn(5, ROPE, generator=gen)
    slots = torch.tensor([17, 3, -1, 63, 40])
    write_through_views(kv_latent[:, None], rotated_key[:, None], cache, slots)
    rows = cache.view(-1, WIDTH)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(rows[slot], torch.cat([kv_latent[t], rotated_key[t]]))
    written = torch.zeros(rows.shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert rows[~written].isnan().all(), "a row no token owns was written"


def test_fp8_write_quantizes_both_latents_with_one_scale():
    cache, _ = latent_cache(2, BLOCK_SIZE, torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(1)
    kv_latent, rotated_key = torch.randn(3, LORA, generator=gen) * 40, torch.randn(3, ROPE, generator=gen)
    scale = torch.tensor(0.05)
    slots = torch.tensor([0, 9, 31])
    write_through_views(kv_latent[:, None], rotated_key[:, None], cache, slots, scale)
    want = ref.quantize(torch.cat([kv_latent, rotated_key], dim=1)[:, None], scale, torch.float8_e4m3fn)
    assert torch.equal(cache.view(-1, WIDTH)[slots].view(torch.uint8), want[:, 0].view(torch.uint8))


def absorbed_case(lens, dtype, seed=2):
    """A latent cache written as an engine writes a float one (through the column views),
    the up-projections and an MLA query for each sequence's last position; returns what
    both forms of the attention need (each sequence's rows ``[n, 576]`` in float64)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [rows_of(gen, n, dtype) for n in lens]
    cache, _, tables, seq_lens = latent_case(lens, BLOCK_SIZE, dtype, seed, rows=rows,
                                             write=write_through_views)
    latents = [torch.cat([latent, rotary], dim=-1)[:, 0].double() for latent, rotary in rows]
    w_uk = torch.randn(HEADS, NOPE, LORA, generator=gen) * LORA ** -0.5
    w_uv = torch.randn(HEADS, V_HEAD, LORA, generator=gen) * LORA ** -0.5
    query = torch.randn(len(lens), HEADS, NOPE + ROPE, generator=gen)
    return cache, tables, seq_lens, latents, w_uk, w_uv, query


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_attention_over_latents_equals_expanded_attention(dtype):
    """Scores q_nope·(W_UK c) + q_rope·k_rope = (q_nope W_UK)·c + q_rope·k_rope, and the
    output W_UV (sum p c) = sum p (W_UV c): attending over the latent rows with the
    absorbed query, then projecting, is DeepSeek's attention over its expanded K/V."""
    lens = [1, 15, 16, 17, 70]
    cache, tables, seq_lens, latents, w_uk, w_uv, query = absorbed_case(lens, dtype)
    scale = (NOPE + ROPE) ** -0.5
    absorbed = torch.cat([torch.einsum("bhn,hnl->bhl", query[..., :NOPE], w_uk), query[..., NOPE:]], dim=-1)
    latent_out = pa.attention(absorbed.to(dtype), cache, cache[..., :LORA], tables, seq_lens, scale)
    got = torch.einsum("bhl,hvl->bhv", latent_out.double(), w_uv.double())
    for i, rows in enumerate(latents):  # float64, expanded per head as transformers runs it
        c, k_rope = rows[:, :LORA], rows[:, LORA:]
        keys = torch.cat([torch.einsum("hnl,tl->htn", w_uk.double(), c),
                          k_rope[None].expand(HEADS, -1, -1)], dim=-1)
        values = torch.einsum("hvl,tl->htv", w_uv.double(), c)
        probs = torch.softmax(torch.einsum("hd,htd->ht", query[i].double(), keys) * scale, dim=-1)
        want = torch.einsum("ht,htv->hv", probs, values)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[i], want, atol=tolerance, rtol=tolerance)


def test_copy_and_swap_move_whole_latent_rows():
    cache, tables, seq_lens, *_ = absorbed_case([20, 5], torch.float32)
    src, dst = int(tables[0, 1]), int(tables[1, 0])
    pa.copy_blocks([cache[..., :LORA]], [cache[..., LORA:]], torch.tensor([[src, dst]]))
    same = dict(atol=0, rtol=0, equal_nan=True)  # the block's unwritten slots are NaN
    torch.testing.assert_close(cache[dst], cache[src], **same)
    host = torch.zeros_like(cache)
    pa.swap_blocks(cache, host, torch.tensor([[src, 0]]))
    torch.testing.assert_close(host[0], cache[src], **same)


def test_compiled_step_over_latent_views_has_no_graph_break():
    cache, tables, seq_lens, _, w_uk, _, query = absorbed_case([9, 33], torch.float32)
    absorbed = torch.cat([torch.einsum("bhn,hnl->bhl", query[..., :NOPE], w_uk), query[..., NOPE:]], dim=-1)
    gen = torch.Generator().manual_seed(3)
    new_rows = torch.randn(2, WIDTH, generator=gen)
    # Each sequence's next position.
    slots = torch.stack([tables[i, int(n) // BLOCK_SIZE].long() * BLOCK_SIZE + int(n) % BLOCK_SIZE
                         for i, n in enumerate(seq_lens)])

    def step(cache, rows, slots, absorbed, tables, seq_lens):
        write_through_views(rows[:, None, :LORA], rows[:, None, LORA:], cache, slots)
        return pa.attention(absorbed, cache, cache[..., :LORA], tables, seq_lens + 1, 0.1)

    eager_cache = cache.clone()
    want = step(eager_cache, new_rows, slots, absorbed, tables, seq_lens)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got = compiled(cache, new_rows, slots, absorbed, tables, seq_lens)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, eager_cache, atol=0, rtol=0, equal_nan=True)


def test_opcheck_on_latent_views():
    cache = torch.zeros(2, 1, BLOCK_SIZE, WIDTH)
    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([0, 5, 20])
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (torch.randn(3, 1, LORA, generator=gen), torch.randn(3, 1, ROPE, generator=gen),
                           cache[..., :LORA], cache[..., LORA:], slots, None, None))
    query = torch.randn(2, HEADS, WIDTH, generator=gen)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.paged.attention.default,
                          (query, cache, cache[..., :LORA], tables, torch.tensor([3, 5], dtype=torch.int32), 0.1))
