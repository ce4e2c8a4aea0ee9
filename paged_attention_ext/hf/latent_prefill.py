"""Long query runs over MLA latent rows: expand the rows they read, attend as multi-head.

Absorbed attention (:mod:`.latent_attention`) spends ``latent + rope + latent`` multiply-adds
per query head and key (576 + 512 for DeepSeek-V3) against ``nope + rope + v_head_dim``
(192 + 128) for the expanded heads; expanding costs ``kv_b_proj`` once per key, ``heads x
(nope + v_head_dim) x latent`` multiply-adds. A sequence with many query rows (a prefill, a
chunked prefill's chunk, the rest of a prompt after a prefix hit) is cheaper expanded, as
vLLM's MLA prefill does: the blocks its context occupies are expanded (``kv_b_proj`` on the
latent, the shared rotary key appended to every head) into a temporary multi-head cache
and the ordinary attention op runs over it with the un-absorbed queries. Decode rows and
short runs stay absorbed. The scores are the same sums in another order: the outputs agree
within rounding.

The temporary cache holds ``heads x (nope + rope + v_head_dim)`` values per context token of
the long sequences (671 MB for 8192 tokens at 128 heads in bf16), for one layer at a time.
"""

from typing import Callable, List

import torch

from ..attention_metadata import AttentionMetadata
from .latent_attention import absorb_query, absorbed_weights, latent_weights, project_output

# Which sequences are expanded, measured with bench/bench_mla_prefill.py (docs/performance.md,
# "MLA: prefill over latent rows"). Per head (both forms scale with the heads alike) and key,
# expanding costs (nope + v_head_dim) x latent multiply-adds once, while each query row the
# absorbed form runs costs 2 x latent - nope - v_head_dim more than an expanded one; the
# absorbed form also maps each query row in and out through W_UK and W_UV, as much as
# expanding one key. So a run of q rows over a context of n keys is expanded when
#   q x (EXPANSION_COST x E + n x A) >= n x EXPANSION_COST x E
# (E, A those two per-key costs), and q >= EXPAND_MIN_QUERIES. EXPANSION_COST weighs the
# expanding GEMM against the attention kernel as measured: the break-even q is ~230 after
# a prefix of 2048, below 32 for a prompt's first run.
EXPAND_MIN_QUERIES = 32
EXPANSION_COST = 1.5


def expands(queries: int, context: int, config) -> bool:
    """Whether a run of ``queries`` rows over ``context`` keys (its own included) is cheaper
    expanded, for a layer of ``config`` (``kv_lora_rank``-wide latents)."""
    nope, value, latent = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    expand = EXPANSION_COST * (nope + value) * latent
    extra = 2 * latent - nope - value
    return queries >= EXPAND_MIN_QUERIES and queries * (expand + context * extra) >= context * expand


def _expanded_cache(module: torch.nn.Module, key_cache: torch.Tensor, blocks: torch.Tensor,
                    heads: int, latent_size: int, dtype: torch.dtype):
    """``blocks`` of the latent pool as multi-head key and value blocks ``[blocks, heads,
    block_size, nope + rope]`` and ``[blocks, heads, block_size, v_head_dim]`` in ``dtype``:
    views of token-major (NHD) buffers, which ``kv_b_proj``'s output already is, so that
    the values are not copied and the keys are written row by row."""
    weight = module.kv_b_proj.weight
    # [blocks, block_size, latent + rope], in the model's dtype as transformers expands them
    rows = key_cache.index_select(0, blocks)[:, 0].to(weight.dtype)
    count, block_size, _ = rows.shape
    per_head = torch.nn.functional.linear(rows[..., :latent_size], weight).to(dtype)
    per_head = per_head.view(count, block_size, heads, -1)
    nope = module.config.qk_nope_head_dim
    rope = rows[..., latent_size:]
    keys = torch.empty(count, block_size, heads, nope + rope.shape[-1], dtype=dtype,
                       device=rows.device)
    keys[..., :nope] = per_head[..., :nope]
    keys[..., nope:] = rope.unsqueeze(2)
    return keys.transpose(1, 2), per_head[..., nope:].transpose(1, 2)


def _subset(metadata: AttentionMetadata, sequences: torch.Tensor,
            query_lens: List[int]) -> AttentionMetadata:
    """``metadata`` of only ``sequences`` (their query rows packed in order)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        metadata.block_tables.index_select(0, sequences),
        metadata.seq_lens.index_select(0, sequences),
        torch.tensor(starts, dtype=torch.int32, device=metadata.seq_lens.device))


def _run_expanded(module: torch.nn.Module, metadata: AttentionMetadata, query: torch.Tensor,
                  key_cache: torch.Tensor, heads: int, latent_size: int, scale: float,
                  op_kwargs) -> torch.Tensor:
    """Attention of every sequence of ``metadata`` (its query rows ``query``, un-absorbed)
    over its expanded blocks."""
    dtype = query.dtype
    block_size = key_cache.shape[2]
    used = (metadata.seq_lens.to(torch.int64) + block_size - 1) // block_size
    width = int(used.max())
    tables = metadata.block_tables[:, :width].to(torch.int64)
    live = torch.arange(width, device=tables.device) < used.unsqueeze(1)
    blocks, local = torch.unique(tables[live], return_inverse=True)
    remapped = torch.zeros_like(tables)
    remapped[live] = local
    keys, values = _expanded_cache(module, key_cache, blocks, heads, latent_size, dtype)
    expanded = AttentionMetadata(remapped.to(torch.int32), metadata.seq_lens,
                                 metadata.query_start_loc)
    return expanded.run(query, keys, values, scale, **op_kwargs)


def _run_absorbed(module: torch.nn.Module, metadata: AttentionMetadata, query: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, heads: int,
                  scale: float, op_kwargs, as_query) -> torch.Tensor:
    latent_size = value_cache.shape[-1]
    q = as_query(absorb_query(query, absorbed_weights(module, heads, latent_size, query.dtype)))
    out = metadata.run(q, key_cache, value_cache, scale, **op_kwargs)
    return project_output(out, absorbed_weights(module, heads, latent_size, out.dtype))


def latent_attention(module: torch.nn.Module, metadata: AttentionMetadata, query: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                     as_query: Callable[[torch.Tensor], torch.Tensor], expand: bool,
                     **op_kwargs) -> torch.Tensor:
    """The attention of ``query`` (``[tokens, heads, nope + rope]``, the layer's queries as
    transformers computed them) over latent rows, ``[tokens, heads, v_head_dim]``: the
    sequences whose runs :func:`expands` expanded when ``expand`` (float caches, eager
    forwards), the others absorbed. ``as_query``: the cache's query cast."""
    heads = query.shape[1]
    latent_weights(module, heads, value_cache.shape[-1])  # refuse what cannot be absorbed
    absorbed = lambda meta, q: _run_absorbed(module, meta, q, key_cache, value_cache, heads,
                                             scale, op_kwargs, as_query)
    if not expand or metadata.query_start_loc is None:  # one query row per sequence
        return absorbed(metadata, query)
    starts = metadata.query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    long = [expands(n, context, module.config)
            for n, context in zip(query_lens, metadata.seq_lens.tolist())]
    if not any(long):
        return absorbed(metadata, query)
    latent_size = value_cache.shape[-1]
    expanded = lambda meta, q: _run_expanded(module, meta, as_query(q), key_cache, heads,
                                             latent_size, scale, op_kwargs)
    if all(long):
        return expanded(metadata, query)
    # A mixed step (the engine packs decodes beside a prefill): each part with its own form.
    out = query.new_empty(query.shape[0], heads, module.config.v_head_dim)
    device = metadata.seq_lens.device
    for form, wanted in ((expanded, True), (absorbed, False)):
        sequences = [i for i, is_long in enumerate(long) if is_long == wanted]
        rows = torch.tensor([r for i in sequences for r in range(starts[i], starts[i + 1])],
                            dtype=torch.int64, device=query.device)
        part = _subset(metadata, torch.tensor(sequences, dtype=torch.int64, device=device),
                       [query_lens[i] for i in sequences])
        out.index_copy_(0, rows, form(part, query.index_select(0, rows)).to(out.dtype))
    return out
