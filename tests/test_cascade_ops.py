"""paged.shared_prefix_attention and paged.merge_attention_states: the CPU kernel's own
cases (instruction sets), the reference against an independent oracle, opcheck,
torch.compile, and refused arguments. The scenarios shared with the CUDA tests are in
attention_scenarios.py (shared_prefix_*, cascade_*, merge_*)."""

import pytest
import torch

import attention_scenarios as scenarios
import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from cpu_isas import ISAS, select_isa
from paged_case import DTYPES, TOLERANCES, query_start_loc, random_query


def small_case(dtype=torch.float32, num_heads=8):
    """Groups with prefixes of 17, 16 and 0 tokens (3, 2, 1 decode rows), GQA 8/2."""
    case = scenarios.shared_prefix_case([17, 16, 0], [3, 2, 1], [1] * 6, 2, 64, 16, dtype)
    return case, random_query(6, num_heads, 64, dtype)


def prefix_args(case, query, **kwargs):
    p = case.prefixes
    return (query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, case.group_starts, 0.125,
            kwargs.get("soft_cap", 0.0), kwargs.get("sinks"))


def test_reference_equals_plain_attention_row_by_row():
    """The shared-prefix reference against ref.attention: a decode row alone over its
    group's prefix (placed at its last position, it sees every prefix key)."""
    case, query = small_case()
    out, lse = ref.shared_prefix_attention(*prefix_args(case, query))
    p = case.prefixes
    for row, g in enumerate(case.group_of):
        want, want_lse = ref.attention_with_lse(query[row:row + 1], p.key_cache, p.value_cache,
                                                p.block_tables[g:g + 1], p.seq_lens[g:g + 1], 0.125)
        torch.testing.assert_close(out[row:row + 1], want)
        torch.testing.assert_close(lse[row:row + 1], want_lse)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instruction_set(isa, dtype):
    select_isa(isa, amx_model=True)
    # Head sizes with their own compile (128), the general one (64), ragged rows (72, 40/128).
    for head_size in (64, 72, 128):
        case = scenarios.shared_prefix_case([1, 15, 16, 17, 300], [8, 1, 3, 2, 4], [1] * 18, 2,
                                            head_size, 16, dtype)
        query = random_query(18, 8, head_size, dtype)
        scenarios.assert_prefix_matches_reference("cpu", query, case.prefixes, case.group_starts,
                                                  head_size ** -0.5, sinks=scenarios.random_sinks(8))
        # Many rows per group: 64 queries of a KV head per work item, then more items.
        starts = query_start_loc([40, 1, 3, 20, 2])
        query = random_query(66, 8, head_size, dtype, seed=4)
        scenarios.assert_prefix_matches_reference("cpu", query, case.prefixes, starts,
                                                  head_size ** -0.5, soft_cap=20.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
def test_opcheck(dtype, sinks):
    case, query = small_case(dtype)
    args = prefix_args(case, query, sinks=torch.randn(8) if sinks else None, soft_cap=5.0)
    torch.library.opcheck(torch.ops.paged.shared_prefix_attention.default, args)
    out, lse = pa.shared_prefix_attention(*args)
    torch.library.opcheck(torch.ops.paged.merge_attention_states.default,
                          ([out, out * 0.5], [lse, lse - 1.0]))


def cascade_step(query, key_cache, value_cache, prefix_tables, prefix_lens, group_starts,
                 suffix_tables, suffix_lens):
    prefix = pa.shared_prefix_attention(query, key_cache, value_cache, prefix_tables, prefix_lens,
                                        group_starts, 0.125)
    suffix = pa.attention_with_lse(query, key_cache, value_cache, suffix_tables, suffix_lens, 0.125)
    return pa.merge_attention_states([prefix[0], suffix[0]], [prefix[1], suffix[1]])[0] * 2.0


def test_compile_fullgraph_cascade_matches_plain_attention():
    case = scenarios.shared_prefix_case([32, 16], [3, 2], [1, 5, 17, 0, 2], 2, 64, 16, torch.float32)
    query = random_query(5, 8, 64, torch.float32)
    p = case.prefixes
    args = (query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, case.group_starts,
            *case.suffix_tables())
    torch._dynamo.reset()
    got = torch.compile(cascade_step, fullgraph=True)(*args)
    w = case.whole
    want = ref.attention(query, w.key_cache, w.value_cache, w.block_tables, w.seq_lens, 0.125) * 2
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    assert torch._dynamo.explain(cascade_step)(*args).graph_break_count == 0


@pytest.mark.parametrize("name,change,error,match", [
    ("group starts length", dict(query_start_loc=query_start_loc([3, 3])), ValueError,
     r"'query_start_loc' must have num_seqs \+ 1 = 4"),
    ("group starts total", dict(query_start_loc=query_start_loc([3, 2, 0])), ValueError,
     "must equal num_tokens"),
    ("group starts decreasing", dict(query_start_loc=torch.tensor([0, 4, 3, 6], dtype=torch.int32)),
     ValueError, "non-decreasing"),
    ("prefix beyond table", dict(seq_lens=torch.tensor([17, 16, 999], dtype=torch.int32)), ValueError,
     r"seq_lens\[2\] = 999"),
    ("block id", dict(block_tables=torch.tensor([[0, 99], [1, 2], [3, 4]], dtype=torch.int32)),
     IndexError, r"block_tables\[0, 1\] = 99"),
    ("table dtype", dict(block_tables=torch.zeros(3, 2, dtype=torch.int64)), TypeError,
     "'block_tables'"),
    ("sinks length", dict(sinks=torch.zeros(3)), ValueError, "'sinks'"),
    ("soft cap", dict(soft_cap=-2.0), ValueError, "'soft_cap'"),
    ("query dtype", dict(query=torch.randn(6, 8, 64, dtype=torch.float64)), TypeError, "'query'"),
    ("fp8 scale with float cache", dict(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0)),
     ValueError, "'k_scale' is only for fp8"),
])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_shared_prefix_attention_rejects(name, change, error, match, device):
    case, query = small_case()
    p = case.prefixes
    args = dict(query=query, key_cache=p.key_cache, value_cache=p.value_cache,
                block_tables=p.block_tables, seq_lens=p.seq_lens, query_start_loc=case.group_starts,
                scale=0.125)
    args.update(change)
    if device == "meta":  # the fakes refuse the dtype and fp8 arguments, as the kernel does
        if name not in ("query dtype", "fp8 scale with float cache"):
            pytest.skip("a data or shape check the kernel makes (the fake only sizes the result)")
        args = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in args.items()}
    with pytest.raises(error, match=match):
        pa.shared_prefix_attention(**args)


@pytest.mark.parametrize("name,make,error,match", [
    ("empty", lambda o, l: ([], []), ValueError, "same number"),
    ("count", lambda o, l: ([o, o], [l]), ValueError, "same number"),
    ("shape", lambda o, l: ([o, o[:, :2]], [l, l]), ValueError, r"'outputs\[1\]' must have the shape"),
    ("dtype", lambda o, l: ([o, o.double()], [l, l]), TypeError, r"'outputs\[1\]'"),
    ("lse dtype", lambda o, l: ([o, o], [l, l.double()]), TypeError, r"'lses\[1\]'"),
    ("lse shape", lambda o, l: ([o, o], [l, l[:2]]), ValueError, r"'lses\[1\]' must have shape"),
    ("rank", lambda o, l: ([o[0], o[0]], [l, l]), ValueError, r"'outputs\[0\]' must be 3-D"),
    ("too many", lambda o, l: ([o] * 17, [l] * 17), ValueError, "at most 16"),
    ("inner stride", lambda o, l: ([o, o.transpose(1, 2).contiguous().transpose(1, 2)], [l, l]),
     ValueError, "contiguous in its last dimension"),
])
def test_merge_rejects(name, make, error, match):
    outputs, lses = make(torch.randn(4, 3, 8), torch.randn(4, 3))
    with pytest.raises(error, match=match):
        pa.merge_attention_states(outputs, lses)


def test_refuse_arguments_that_require_grad():
    case, query = small_case()
    args = list(prefix_args(case, query.requires_grad_()))
    with pytest.raises(NotImplementedError, match="'query' requires grad"):
        pa.shared_prefix_attention(*args)
    out = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="'outputs' requires grad"):
        pa.merge_attention_states([out, out], [torch.randn(2, 3)] * 2)
    with torch.no_grad():
        pa.merge_attention_states([out, out], [torch.randn(2, 3)] * 2)
