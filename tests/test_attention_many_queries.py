"""bf16 items with many queries per KV head against the reference, on every instruction set.

MLA decode over latent rows puts 16 to 128 query heads on one KV head whose 576-wide row is
the key and whose first 512 columns are the value (one memory); GQA items of 16 and more
queries per KV head, decode or multi-token, have the same shape with ordinary rows. These
items run the queries-in-rows register tiles (vdpbf16ps on avx512_bf16) many times per chunk:
partial chunks (lengths around the block size and the 32-key chunk), unused slots holding
NaN or huge values next to the rows, value head sizes with a 32-column tail and the
driver's masks and modifiers (windows, soft cap, sinks, ALiBi) are where they could go wrong.
"""

import pytest
import torch

import attention_scenarios as scenarios
from cpu_isas import ISAS, select_isa
from paged_case import PagedCase, free_out_of_window, make_case, query_start_loc, random_query

LORA, ROPE = 512, 64
BLOCK_SIZE = 16
# 1, bs - 1, bs, bs + 1, a chunk less and more one, and longer, a ragged tail each.
LENS = [1, 15, 16, 17, 31, 33, 70, 129]


def latent_case(lens, poison: float, seed: int = 0) -> PagedCase:
    """An MLA latent cache: one 576-wide row per token, the value cache its first 512
    columns (one memory), unused slots poisoned."""
    case = make_case(lens, 1, LORA + ROPE, BLOCK_SIZE, torch.bfloat16, seed=seed, poison=None)
    case = PagedCase(case.key_cache, case.key_cache[..., :LORA], case.block_tables, case.seq_lens,
                     case.used_slots)
    case.poison_unused(poison)
    return case


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("poison", [float("nan"), 3e38])
def test_latent_decode(isa, heads, poison):
    select_isa(isa)
    case = latent_case(LENS, poison)
    query = random_query(len(LENS), heads, LORA + ROPE, torch.bfloat16)
    scenarios.assert_matches_reference("cpu", query, case, (128 + ROPE) ** -0.5)


@pytest.mark.parametrize("isa", ISAS)
def test_latent_decode_with_masks_and_modifiers(isa):
    """The driver's window, soft cap, sinks and ALiBi over many queries' scores."""
    select_isa(isa)
    heads = 16
    case = latent_case(LENS, float("nan"), seed=3)
    query = random_query(len(LENS), heads, LORA + ROPE, torch.bfloat16, seed=4)
    scale = (128 + ROPE) ** -0.5
    sinks = scenarios.random_sinks(heads)
    scenarios.assert_matches_reference("cpu", query, case, scale, soft_cap=20.0, sinks=sinks)
    slopes = torch.linspace(-0.3, 0.2, heads)
    scenarios.assert_matches_reference("cpu", query, case, scale, alibi_slopes=slopes)
    windowed = free_out_of_window(case, 21)
    scenarios.assert_matches_reference("cpu", query, windowed, scale, sliding_window=21, sinks=sinks)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_size,head_size_v", [(128, 128), (160, 96), (64, 32)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 2), (64, 1), (24, 2)])
def test_gqa_decode(isa, head_size, head_size_v, num_heads, num_kv_heads):
    """12 to 64 queries per KV head, value tails of 32 (96) and a value row of 32."""
    select_isa(isa, amx_model=True)
    case = make_case(LENS, num_kv_heads, head_size, BLOCK_SIZE, torch.bfloat16, seed=5,
                     head_size_v=head_size_v)
    query = random_query(len(LENS), num_heads, head_size, torch.bfloat16, seed=6)
    scenarios.assert_matches_reference("cpu", query, case, head_size ** -0.5,
                                       sinks=scenarios.random_sinks(num_heads))


@pytest.mark.parametrize("isa", ISAS)
def test_gqa_multi_token(isa):
    """Causal rows of a GQA group (8 queries per KV head: 16 and more from 2 rows on)
    whose chunks the driver masks, with a window and a soft cap."""
    select_isa(isa, amx_model=True)
    q_lens, lens = [1, 2, 5, 17, 40], [3, 18, 33, 40, 100]
    case = make_case(lens, 2, 128, BLOCK_SIZE, torch.bfloat16, seed=7)
    query = random_query(sum(q_lens), 16, 128, torch.bfloat16, seed=8)
    qsl = query_start_loc(q_lens)
    scenarios.assert_matches_reference("cpu", query, case, 128 ** -0.5, query_start_loc=qsl)
    windowed = free_out_of_window(case, 23, q_lens)
    scenarios.assert_matches_reference("cpu", query, windowed, 128 ** -0.5, query_start_loc=qsl,
                                       sliding_window=23, soft_cap=30.0,
                                       sinks=scenarios.random_sinks(16))
