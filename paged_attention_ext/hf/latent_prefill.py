"""Long query runs over MLA latent rows: expand the rows they read, attend as multi-head.

Absorbed attention (:mod:`.latent_attention`) spends ``latent + rope + latent`` multiply-adds
per query head and key (576 + 512 for DeepSeek-V3) against ``nope + rope + v_head_dim``
(192 + 128) for the expanded heads; expanding costs ``kv_b_proj`` once per key, ``heads x
(nope + v_head_dim) x latent`` multiply-adds. A sequence with many query rows (a prefill, a
chunked prefill's chunk, the rest of a prompt after a prefix hit) is cheaper expanded, as
vLLM's MLA prefill does: the blocks its context occupies make a temporary multi-head cache,
the run's own tokens as transformers expanded them for the attention call (``kv_b_proj``
on their latents, the shared rotary key appended to every head), the context before the
run (a prefix hit, earlier chunks) expanded here the same way from the latent rows, and
the ordinary attention op runs over it with the un-absorbed queries. Decode rows and
short runs stay absorbed. The scores are the same sums in another order: the outputs agree
within rounding.

The temporary cache holds ``heads x (nope + rope + v_head_dim)`` values per context token of
the long sequences, for one layer at a time.

A step's lengths are every layer's, so which runs expand and the temporary cache's layout
(its blocks, the slots of the runs' own tokens) are planned once per step
(:class:`LatentRuns`, from the step's host lists, :func:`step_runs`) and run per layer, as
:class:`~paged_attention_ext.attention_metadata.AttentionMetadata` is.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..attention_metadata import AttentionMetadata
from ..cascade import query_starts
from ..step_inputs import StepPlan
from ..token_quantization import head_size_of
from .batch import PagedBatch
from .latent_attention import absorb_query, absorbed_weights, latent_weights, project_output

# Which sequences are expanded, measured with bench/bench_mla_prefill.py (docs/performance.md,
# "MLA: prefill over latent rows"). Per head (both forms scale with the heads alike) and key
# of the context before a run, expanding costs E = (nope + v_head_dim) x latent multiply-adds
# once (the run's own keys transformers has expanded already), while each query row the
# absorbed form runs costs A = 2 x latent - nope - v_head_dim more per key than an expanded
# one, and E to map it in and out through W_UK and W_UV. So a run of q rows over a context of
# n keys, b = n - q of them before it, is expanded when
#   q x (EXPANSION_COST x E + n x A) >= b x EXPANSION_COST x E
# and q >= EXPAND_MIN_QUERIES: a prompt's first run always, a run after a long prefix only
# when it is a sizeable fraction of it. EXPANSION_COST weighs the expanding GEMM against the
# attention kernels as measured.
EXPAND_MIN_QUERIES = 32
EXPANSION_COST = 1.5


def expands(queries: int, context: int, config) -> bool:
    """Whether a run of ``queries`` rows over ``context`` keys (its own included) is cheaper
    expanded, for a layer of ``config`` (``kv_lora_rank``-wide latents)."""
    nope, value, latent = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    expand = EXPANSION_COST * (nope + value) * latent
    extra = 2 * latent - nope - value
    return (queries >= EXPAND_MIN_QUERIES
            and queries * (expand + context * extra) >= (context - queries) * expand)


def _expand_blocks(module: torch.nn.Module, key_cache: torch.Tensor, blocks: torch.Tensor,
                   latent_size: int, dtype: torch.dtype):
    """The latent pool's ``blocks`` expanded, token-major (NHD, as ``kv_b_proj``'s output
    is): keys ``[blocks, block_size, heads, nope + rope]``, values ``[..., v_head_dim]``."""
    weight = module.kv_b_proj.weight
    # [blocks, block_size, latent + rope], in the model's dtype as transformers expands them
    rows = key_cache.index_select(0, blocks)[:, 0].to(weight.dtype)
    count, block_size, _ = rows.shape
    per_head = torch.nn.functional.linear(rows[..., :latent_size], weight).to(dtype)
    nope, value = module.config.qk_nope_head_dim, module.config.v_head_dim
    per_head = per_head.view(count, block_size, -1, nope + value)
    rope = rows[..., latent_size:].to(dtype)
    keys = torch.cat((per_head[..., :nope],
                      rope.unsqueeze(2).expand(-1, -1, per_head.shape[2], -1)), dim=-1)
    return keys, per_head[..., nope:]


def _subset(metadata: AttentionMetadata, sequences: List[int],
            query_lens: Sequence[int]) -> AttentionMetadata:
    """``metadata`` of only ``sequences`` (their query rows packed in order)."""
    device = metadata.seq_lens.device
    index = torch.tensor(sequences, dtype=torch.int64, device=device)
    starts = query_starts(query_lens[i] for i in sequences)
    return AttentionMetadata(metadata.block_tables.index_select(0, index),
                             metadata.seq_lens.index_select(0, index),
                             torch.tensor(starts, dtype=torch.int32, device=device))


@dataclass(frozen=True)
class _Expansion:
    """The temporary multi-head cache of a step's expanded sequences, the same for every
    layer: the pool ``blocks`` it holds (in its own order), the ones holding context before
    a run (``earlier``: expanded from the latent rows), the ``slots`` of the runs' own
    tokens (one per query row), and the attention metadata over it."""

    blocks: torch.Tensor
    earlier: torch.Tensor
    slots: torch.Tensor
    metadata: AttentionMetadata


def _plan_expansion(metadata: AttentionMetadata, max_seq_len: int, num_rows: int,
                    block_size: int) -> _Expansion:
    """The :class:`_Expansion` of every sequence of ``metadata`` (``num_rows`` query rows,
    none longer than ``max_seq_len`` keys)."""
    device = metadata.seq_lens.device
    seq_lens = metadata.seq_lens.to(torch.int64)
    starts = metadata.query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    width = -(-max_seq_len // block_size)
    tables = metadata.block_tables[:, :width].to(torch.int64)
    columns = torch.arange(width, device=device)
    live = columns < ((seq_lens + block_size - 1) // block_size).unsqueeze(1)
    blocks, local = torch.unique(tables[live], return_inverse=True)
    remapped = torch.zeros_like(tables)
    remapped[live] = local
    # The blocks that hold context before a run (a prefix hit, earlier chunks) are expanded
    # whole; the run's own positions are then overwritten with transformers' rows.
    before = seq_lens - query_lens
    earlier = torch.unique(remapped[columns < ((before + block_size - 1) // block_size).unsqueeze(1)])
    sequence = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=device), query_lens)
    position = before[sequence] + torch.arange(num_rows, device=device) - starts[:-1][sequence]
    slots = remapped[sequence, position // block_size] * block_size + position % block_size
    return _Expansion(blocks, earlier, slots, AttentionMetadata(
        remapped.to(torch.int32), metadata.seq_lens, metadata.query_start_loc))


def _run_expanded(module: torch.nn.Module, expansion: _Expansion, query: torch.Tensor,
                  new_keys: torch.Tensor, new_values: torch.Tensor, key_cache: torch.Tensor,
                  latent_size: int, scale: float, op_kwargs) -> torch.Tensor:
    """One layer's attention of the sequences of ``expansion`` (their query rows ``query``,
    un-absorbed) over their blocks expanded: the runs' own tokens are ``new_keys`` and
    ``new_values`` (what transformers expanded for the attention call, one row per query
    row), the context before the runs is expanded from the layer's latent rows here."""
    dtype, device = query.dtype, query.device
    block_size = key_cache.shape[2]
    count, heads = expansion.blocks.shape[0], query.shape[1]
    keys = torch.empty(count, block_size, heads, new_keys.shape[-1], dtype=dtype, device=device)
    values = torch.empty(count, block_size, heads, new_values.shape[-1], dtype=dtype,
                         device=device)
    if expansion.earlier.numel():
        expanded_keys, expanded_values = _expand_blocks(
            module, key_cache, expansion.blocks[expansion.earlier], latent_size, dtype)
        keys.index_copy_(0, expansion.earlier, expanded_keys)
        values.index_copy_(0, expansion.earlier, expanded_values)
    keys.view(-1, heads, keys.shape[-1]).index_copy_(0, expansion.slots, new_keys.to(dtype))
    values.view(-1, heads, values.shape[-1]).index_copy_(0, expansion.slots, new_values.to(dtype))
    return expansion.metadata.run(query, keys.transpose(1, 2), values.transpose(1, 2), scale,
                                  **op_kwargs)


def _run_absorbed(module: torch.nn.Module, metadata: AttentionMetadata, query: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, heads: int,
                  scale: float, op_kwargs, as_query) -> torch.Tensor:
    latent_size = head_size_of(value_cache)  # a packed int4 row holds twice its bytes
    q = as_query(absorb_query(query, absorbed_weights(module, heads, latent_size, query.dtype)))
    out = metadata.run(q, key_cache, value_cache, scale, **op_kwargs)
    return project_output(out, absorbed_weights(module, heads, latent_size, out.dtype))


@dataclass(frozen=True)
class _Part:
    """Sequences of a step that attend in one form: their query rows (None: every row of
    the step), their metadata, and for the expanded form its temporary cache."""

    rows: Optional[torch.Tensor]
    metadata: AttentionMetadata
    expansion: Optional[_Expansion]


class LatentRuns:
    """Which sequences of a step attend expanded and which absorbed, for one MLA shape, and
    each part's metadata: decided once per step from the step's lengths on the host (every
    layer's), then read by every layer, as :class:`AttentionMetadata` is (plan once, run per
    layer).

    Args:
        metadata: the step's metadata (with ``query_start_loc``).
        query_lens, seq_lens: its lengths on the host.
        config: the model's config (``qk_nope_head_dim``, ``v_head_dim``, ``kv_lora_rank``).
        block_size: the latent pool's.
        plan: the step's host lists these were decided from, if any (which step they serve).
    """

    def __init__(self, metadata: AttentionMetadata, query_lens: Sequence[int],
                 seq_lens: Sequence[int], config, block_size: int,
                 plan: Optional[StepPlan] = None) -> None:
        self.metadata, self.plan = metadata, plan
        self.shape = _shape(config, block_size)
        long = [expands(n, context, config) for n, context in zip(query_lens, seq_lens)]
        if not any(long):
            self.parts = [_Part(None, metadata, None)]
            return
        if all(long):
            self.parts = [_Part(None, metadata, _plan_expansion(
                metadata, max(seq_lens), sum(query_lens), block_size))]
            return
        # A mixed step (the engine packs decodes beside a prefill): each part with its own form.
        starts = query_starts(query_lens)
        self.parts = []
        for wanted in (True, False):
            sequences = [i for i, is_long in enumerate(long) if is_long == wanted]
            rows = torch.tensor([r for i in sequences for r in range(starts[i], starts[i + 1])],
                                dtype=torch.int64, device=metadata.seq_lens.device)
            part = _subset(metadata, sequences, query_lens)
            expansion = (_plan_expansion(part, max(seq_lens[i] for i in sequences), rows.shape[0],
                                         block_size) if wanted else None)
            self.parts.append(_Part(rows, part, expansion))

    @classmethod
    def read(cls, metadata: AttentionMetadata, config, block_size: int,
             plan: Optional[StepPlan] = None) -> "LatentRuns":
        """The runs of ``metadata``, its lengths read back from its tensors."""
        starts = metadata.query_start_loc.tolist()
        return cls(metadata, [b - a for a, b in zip(starts, starts[1:])],
                   metadata.seq_lens.tolist(), config, block_size, plan)


def _shape(config, block_size: int) -> Tuple[int, ...]:
    """What the decision depends on besides the step: the layer's sizes and the pool's blocks."""
    return config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank, block_size


def step_runs(batch: PagedBatch, metadata: AttentionMetadata, config,
              block_size: int) -> LatentRuns:
    """The :class:`LatentRuns` of ``batch``'s step over ``metadata``: decided by the step's
    first latent layer from the step's host lists (its ``StepPlan``), kept on the batch for
    the others. A batch a compiled cache hands out again for every step of its shape gets
    them anew for each step's plan; one built without a plan reads them back each time."""
    plan, inputs = batch.inputs.plan, batch.inputs
    runs = batch.latent_runs
    if (runs is not None and plan is not None and runs.plan is plan and runs.metadata is metadata
            and runs.shape == _shape(config, block_size)):
        return runs
    if plan is not None and metadata.seq_lens is inputs.seq_lens \
            and metadata.query_start_loc is inputs.query_start_loc:
        runs = LatentRuns(metadata, plan.query_lens, plan.seq_lens, config, block_size, plan)
    else:  # lengths the plan does not list (a chunked group's), or no plan
        runs = LatentRuns.read(metadata, config, block_size, plan)
    batch.latent_runs = runs
    return runs


def latent_attention(module: torch.nn.Module, metadata: AttentionMetadata, query: torch.Tensor,
                     key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                     key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                     as_query: Callable[[torch.Tensor], torch.Tensor],
                     batch: Optional[PagedBatch] = None, **op_kwargs) -> torch.Tensor:
    """The attention of ``query`` (``[tokens, heads, nope + rope]``, the layer's queries as
    transformers computed them) over latent rows, ``[tokens, heads, v_head_dim]``: the
    sequences whose runs :func:`expands` expanded, the others absorbed. ``key`` and
    ``value``: transformers' expanded keys and values of the query tokens (the same rows),
    or None to read every sequence absorbed (quantized caches, compiled graphs).
    ``as_query``: the cache's query cast. ``batch``: the step's, which keeps the decision
    for its other layers (:func:`step_runs`); None: decided from ``metadata`` here."""
    heads = query.shape[1]
    latent_weights(module, heads, head_size_of(value_cache))  # refuse what cannot be absorbed
    if key is None or value is None or metadata.query_start_loc is None:
        return _run_absorbed(module, metadata, query, key_cache, value_cache, heads, scale,
                             op_kwargs, as_query)
    block_size = key_cache.shape[2]
    runs = (LatentRuns.read(metadata, module.config, block_size) if batch is None
            else step_runs(batch, metadata, module.config, block_size))
    latent_size = head_size_of(value_cache)

    def run(part: _Part) -> torch.Tensor:
        rows = lambda t: t if part.rows is None else t.index_select(0, part.rows)
        if part.expansion is None:
            return _run_absorbed(module, part.metadata, rows(query), key_cache, value_cache,
                                 heads, scale, op_kwargs, as_query)
        return _run_expanded(module, part.expansion, *(as_query(rows(t)) for t in (query, key, value)),
                             key_cache, latent_size, scale, op_kwargs)

    if len(runs.parts) == 1:
        return run(runs.parts[0])
    out = query.new_empty(query.shape[0], heads, module.config.v_head_dim)
    for part in runs.parts:
        out.index_copy_(0, part.rows, run(part).to(out.dtype))
    return out
