"""Long query runs over MLA latent rows are expanded to per-head keys and values and attended
as multi-head (hf/latent_prefill.py); decode rows and short runs stay absorbed. Both forms
must agree on every sequence of a step: prefills, prefix hits (context beyond the queries),
decodes packed beside them, blocks shared between sequences, a sliding window and sinks.
Token equality with eager through the expanded form: test_hf_mla_latent.py and
test_engine_mla.py."""

import types

import pytest
import torch

from paged_attention_ext import AttentionMetadata
from paged_attention_ext.hf import latent_prefill
from paged_attention_ext.hf.batch import PagedBatch
from paged_attention_ext.step_inputs import StepInputs, StepPlan

LORA, ROPE, NOPE, V_HEAD, HEADS, BLOCK = 64, 16, 32, 24, 4, 4

pytestmark = pytest.mark.usefixtures("one_thread")


def layer(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.Module()
    module.kv_b_proj = torch.nn.Linear(LORA, HEADS * (NOPE + V_HEAD), bias=False).to(dtype)
    module.config = types.SimpleNamespace(qk_nope_head_dim=NOPE, v_head_dim=V_HEAD,
                                          kv_lora_rank=LORA)
    module.layer_idx = 0
    return module


def step(seq_lens, query_lens, tables, num_blocks, dtype):
    """A latent pool (NaN in every row no sequence reads), its metadata, and queries."""
    cache = torch.full((num_blocks, 1, BLOCK, LORA + ROPE), float("nan"), dtype=dtype)
    for table, n in zip(tables, seq_lens):
        for position in range(n):
            cache[table[position // BLOCK], 0, position % BLOCK] = torch.randn(LORA + ROPE)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32))
    query = torch.randn(sum(query_lens), HEADS, NOPE + ROPE).to(dtype)
    return cache, metadata, query


def new_rows(module, cache, metadata):
    """What transformers hands the attention function besides the queries: the expanded
    keys and values of each sequence's last ``query_len`` tokens, in query order."""
    keys, values = [], []
    lens = metadata.seq_lens.tolist()
    starts = (list(range(len(lens) + 1)) if metadata.query_start_loc is None
              else metadata.query_start_loc.tolist())
    for table, n, a, b in zip(metadata.block_tables.tolist(), lens, starts, starts[1:]):
        for position in range(n - (b - a), n):
            row = cache[table[position // BLOCK], 0, position % BLOCK].to(module.kv_b_proj.weight.dtype)
            per_head = module.kv_b_proj(row[:LORA]).view(HEADS, NOPE + V_HEAD)
            keys.append(torch.cat((per_head[:, :NOPE], row[LORA:].expand(HEADS, ROPE)), dim=-1))
            values.append(per_head[:, NOPE:])
    return torch.stack(keys), torch.stack(values)


@torch.no_grad()
def attend(module, cache, metadata, query, expand, **kwargs):
    key, value = new_rows(module, cache, metadata) if expand else (None, None)
    return latent_prefill.latent_attention(module, metadata, query, key, value, cache,
                                           cache[..., :LORA], (NOPE + ROPE) ** -0.5,
                                           lambda q: q, **kwargs)


def only_query_rows_count(monkeypatch, rows):
    """Expand every run of at least ``rows`` query rows, whatever its context."""
    monkeypatch.setattr(latent_prefill, "EXPAND_MIN_QUERIES", rows)
    monkeypatch.setattr(latent_prefill, "EXPANSION_COST", 0.0)


def spy_expanded(monkeypatch):
    calls = []
    run = latent_prefill._run_expanded

    def counted(module, metadata, query, *args):
        calls.append(query.shape[0])
        return run(module, metadata, query, *args)
    monkeypatch.setattr(latent_prefill, "_run_expanded", counted)
    return calls


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kwargs", [{}, dict(sliding_window=5),
                                    dict(sinks=torch.linspace(-1.0, 1.0, HEADS))])
def test_expanded_runs_equal_absorbed_in_a_mixed_step(monkeypatch, dtype, tolerance, kwargs):
    only_query_rows_count(monkeypatch, 3)
    calls = spy_expanded(monkeypatch)
    module = layer(dtype)
    # A prefill, a decode, a prefix hit sharing the prefill's first two blocks, a short run
    # below the threshold, another prefill.
    seq_lens, query_lens = [10, 7, 13, 6, 3], [10, 1, 5, 2, 3]
    tables = [[0, 1, 2], [3, 4], [0, 1, 5, 6], [7, 8], [9]]
    cache, metadata, query = step(seq_lens, query_lens, tables, 10, dtype)
    want = attend(module, cache, metadata, query, expand=False, **kwargs)
    got = attend(module, cache, metadata, query, expand=True, **kwargs)
    assert calls == [10 + 5 + 3]  # the three long runs, in one call
    assert got.shape == (sum(query_lens), HEADS, V_HEAD) and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_a_step_of_only_long_runs_or_only_short_ones_takes_one_form(monkeypatch):
    only_query_rows_count(monkeypatch, 3)
    calls = spy_expanded(monkeypatch)
    module = layer()
    cache, metadata, query = step([9, 4], [9, 3], [[0, 1, 2], [3]], 4, torch.float32)
    torch.testing.assert_close(attend(module, cache, metadata, query, expand=True),
                               attend(module, cache, metadata, query, expand=False))
    assert calls == [12]
    cache, metadata, query = step([9, 4], [2, 1], [[0, 1, 2], [3]], 4, torch.float32)
    attend(module, cache, metadata, query, expand=True)
    decode = AttentionMetadata(metadata.block_tables, metadata.seq_lens)
    attend(module, cache, decode, query[:2], expand=True)
    assert calls == [12]


def test_a_step_decides_once_for_its_layers_and_a_reused_batch_anew_for_each_step(monkeypatch):
    """The engine's and a cache's batches carry the step's plan: every layer reads its
    decision (no lengths read back from the tensors); a compiled cache's batch, handed out
    again with its buffers rewritten and a new plan, decides again."""
    only_query_rows_count(monkeypatch, 3)
    module = layer()
    cache, metadata, query = step([9, 4], [9, 3], [[0, 1, 2], [3]], 4, torch.float32)
    want = attend(module, cache, metadata, query, expand=True)
    next_step = AttentionMetadata(metadata.block_tables, metadata.seq_lens,
                                  torch.tensor([0, 2, 3], dtype=torch.int32))
    short = attend(module, cache, next_step, query[:3], expand=False)
    calls = spy_expanded(monkeypatch)
    monkeypatch.setattr(latent_prefill.LatentRuns, "read",
                        lambda *args: pytest.fail("the step's lengths read back from tensors"))
    inputs = StepInputs((torch.zeros(12, dtype=torch.int64),), (metadata.block_tables,),
                        metadata.seq_lens, metadata.query_start_loc,
                        plan=StepPlan(([[0, 1, 2], [3]],), ([0] * 12,), [9, 4], [9, 3]))
    batch = PagedBatch(None, inputs)
    for _ in range(2):  # two layers
        torch.testing.assert_close(attend(module, cache, inputs.attention[0], query, expand=True,
                                          batch=batch), want)
    runs = batch.latent_runs
    assert calls == [12, 12] and runs.plan is inputs.plan
    # The next step in the same buffers: short runs only, absorbed.
    inputs.query_start_loc.copy_(next_step.query_start_loc)
    inputs.plan = StepPlan(([[0, 1, 2], [3]],), ([0] * 3,), [9, 4], [2, 1])
    torch.testing.assert_close(attend(module, cache, inputs.attention[0], query[:3], expand=True,
                                      batch=batch), short)
    assert calls == [12, 12] and batch.latent_runs is not runs


def test_the_expanded_form_refuses_what_cannot_be_absorbed_too(monkeypatch):
    only_query_rows_count(monkeypatch, 1)
    module = layer()
    module.kv_b_proj = torch.nn.Linear(LORA, HEADS * (NOPE + V_HEAD), bias=True)
    cache, metadata, query = step([5], [5], [[0, 1]], 2, torch.float32)
    with pytest.raises(NotImplementedError, match="kv_b_proj with a bias.*mla_storage='expanded'"):
        attend(module, cache, metadata, query, expand=True)


def test_which_runs_are_expanded_at_deepseek_v3s_sizes():
    """A prompt's first run from 32 rows; after a prefix of 2048 tokens, from about 210
    (bench/bench_mla_prefill.py); decode never."""
    config = types.SimpleNamespace(qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    expands = lambda queries, context: latent_prefill.expands(queries, context, config)
    assert not expands(1, 8192) and not expands(16, 16) and not expands(31, 31)
    assert expands(32, 32) and expands(4096, 4096) and expands(512, 2560) and expands(256, 2304)
    assert not expands(128, 2176) and not expands(64, 2112) and not expands(200, 8392)


def test_the_runs_own_tokens_come_from_transformers_and_the_context_before_from_the_rows(
        monkeypatch):
    only_query_rows_count(monkeypatch, 3)
    module = layer()
    # A prompt's first run, and a run after 6 tokens of context (its block 3 half context).
    cache, metadata, query = step([7, 11], [7, 5], [[0, 1], [2, 3, 4]], 5, torch.float32)
    want = attend(module, cache, metadata, query, expand=False)
    key, value = new_rows(module, cache, metadata)
    # The runs' own rows unreadable: the expanded form must take transformers' instead.
    for table, n, q in zip(metadata.block_tables.tolist(), (7, 11), (7, 5)):
        for position in range(n - q, n):
            cache[table[position // BLOCK], 0, position % BLOCK] = float("nan")
    with torch.no_grad():
        got = latent_prefill.latent_attention(module, metadata, query, key, value, cache,
                                              cache[..., :LORA], (NOPE + ROPE) ** -0.5, lambda q: q)
    torch.testing.assert_close(got, want)
