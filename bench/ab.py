"""Two builds of the CPU kernels side by side: is a change faster, on this machine, now?

Usage::

    .venv/bin/python bench/ab.py SUITE --baseline DIR [--rounds N] [--reps N] [--out PATH] [options]

``DIR`` is another checkout of this repository with its extension built in place
(``git worktree add DIR COMMIT && cd DIR && python setup.py build_ext --inplace``). One
process cannot load both builds (both register the ``paged`` op namespace), so each round
runs one worker process per build (``bench/ab.py SUITE --worker``), back to back, in
alternating order (``bench/common/ab.py``); the host's bandwidth moves in bursts of seconds
to minutes, so the two workers of a round usually see the same state. Every suite reports
each build's median over rounds and the median (and range) of the per-round ratio
current / baseline. Correctness is the tests' job.

Suites (``kernels`` writes ``bench/results/cpu_kernel_ab.json``, the others
``cpu_multi_token_ab.json``, ``cpu_amx_ab.json``, ``cpu_shared_prefix_ab.json``,
``cpu_decode_context_ab.json`` there, unless
``--out`` says otherwise):

``kernels``
    Decode B=16, 32 query heads, head size 128, context 2048, block 16, on huge-page pools,
    fp32 / bf16 / fp16 x 32 / 8 KV heads: from DRAM (random block order, timed against the
    1 GiB read sum of ``bench_cpu_perf.py``, so also % of the read), from L3 (all sequences
    share 512 tokens of blocks; timed back to back, since after the read the cache would be
    cold) and from L2 (tables cycling over 256 KiB of blocks: the arithmetic alone); and
    multi-token (512 queries over 4096 tokens, 32/8 heads) in fp32 and bf16, in GFLOP/s.
    DRAM rows also give the medians over the rounds in which both workers saw the host's
    fast (read > 65 GB/s) or slow read state.
``multi-token`` [``--isa ISA``] [``--modifier window|alibi|soft-cap``]
    Causal multi-token (512 queries over 4096 tokens, 32/8 heads, head size 128, block 16,
    random block order) on fp32, bf16, fp16, e4m3 and e5m2 caches (fp8 with a bf16 query
    and unit scales) and per-token int8 and int4 caches (bf16 query), best of ``--reps`` calls, in GFLOP/s, with each dtype's rate against
    the same worker's fp32 (the "never slower per element than fp32" target). ``--modifier
    window`` adds a sliding window of 1024 keys (the FLOP count is then each query's 1024
    keys), ``alibi`` ALiBi slopes, ``soft-cap`` a soft cap of 50 (environment variable
    ``AB_MULTI_TOKEN_MODIFIER``).
``amx`` [``--isa ISA``] [``--cases WORDS``] [``--huge-pages``]
    The shapes the ``amx`` tile kernel takes, on bf16 and e4m3 caches (bf16 queries, unit
    scales, random block order, head size 128, block 16): grouped decode 16/8 and 32/8 at
    context 2048, 32/4 and 32/1 at 8192 (B=16), in KV GB/s, and causal multi-token (512
    queries at the end of 4096 tokens, 32/8) in GFLOP/s; two threads, best of ``--reps``
    calls. ``--cases bf16,decode`` keeps the cases whose names contain every listed word;
    ``--huge-pages`` puts the caches on huge pages (as ``PagedCache`` allocates them)
    instead of torch's 4 KiB pages; ``--isa avx512_vbmi`` times these shapes on another
    kernel (default ``amx``). The environment variables ``AB_AMX_CASES``,
    ``AB_AMX_HUGE_PAGES=1`` and ``AB_AMX_ISA`` do the same.
``isa-matrix`` [``--isa ISA[,ISA...]``]
    The decode rows of ``bench_cpu_perf.py --sections isa_matrix``: every kernel the CPU
    runs (or those ``--isa`` names) x fp32, bf16, fp16, e4m3, e5m2 caches x 32/32 and 32/8
    heads (B=16, context 2048, block 16, head size 128, huge-page pools, random block
    order), from DRAM and with the KV resident in L2, in GB/s of KV. Besides each row's
    paired ratio, the report counts the rounds in which the current build was faster, with
    a two-sided sign test per row over its rounds, and the rows whose median ratio is above 1
    (a count, not a test: rows timed in the same worker processes move together, and a build
    against itself has had 33 of 40 rows above 1).
``shared-prefix`` [``--isa ISA``] [``--cases WORDS``]
    ``shared_prefix_attention`` (the queries-in-lanes kernels: every query sees every key):
    groups of 8 and 16 decode rows over prefixes of 4096 and 2048 tokens (one group each,
    32 query heads, head size 128, block 16, random block order) on fp32, bf16, fp16, e4m3
    and e5m2 caches (fp8 with a bf16 query and unit scales) at 32/8 and 32/32 heads, and
    bf16 32/8 with a soft cap, best of ``--reps`` calls, in GFLOP/s. ``--cases`` as for
    ``amx`` (``--cases "soft cap"``; environment variable ``AB_SHARED_PREFIX_CASES``).
``decode-context``
    bf16 decode, 32/8 heads, head size 128, block 16, bf16 queries and outputs, at contexts
    256, 512, 2048 and 16384 with B = 1 GiB of KV / context: each context its own 1 GiB of
    huge-page pools in a random block order, the caches flushed by a 1 GiB read before
    every call, the contexts in a rotating order, best of ``--reps`` calls, in GB/s of KV.
    Short contexts are many short items, each with its own set-up, output rows and
    pipeline start: where per-item and per-call work shows. Two threads, the CPU's own
    kernel or ``PAGED_ATTENTION_CPU_ISA``.
"""

import argparse
import os
import statistics
from pathlib import Path
from typing import Callable, Dict, List

from common.ab import add_ab_arguments, ab_rounds, paired, write_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
Rounds = List[Dict[str, Dict[str, object]]]


def source_and_cpu() -> Dict[str, str]:
    from common.environment import cpu_details, cpu_model, source_revision
    # The model name alone ("AMD EPYC") does not tell Zen 4 from Zen 5: family and model do.
    return {"cpu": cpu_model(), "cpu_details": cpu_details(), "source": source_revision()}


# --- kernels ---------------------------------------------------------------------------

FAST_READ_GBPS = 65.0  # between the two read states of the host it was written on (~45-55, ~75-85 GB/s)


def kernels_worker(reps: int) -> Dict[str, object]:
    """Every configuration with the paged_attention_ext found on sys.path."""
    import torch

    import paged_attention_ext as pa
    from common.environment import source_revision
    from common.timing import time_interleaved_samples
    from cpu_perf.config import (BATCH, BLOCK_SIZE, CONTEXT, DTYPES, HEAD_SIZE, KV_HEADS, L3_CONTEXT,
                                 MT_DTYPES, MT_KV_HEADS, NUM_HEADS)
    from cpu_perf.decode import cache_resident, core_resident, decode_case
    from cpu_perf.machine import Pool, random_pattern
    from cpu_perf.multi_token import multi_token_case
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    pool_bytes = BATCH * CONTEXT * NUM_HEADS * HEAD_SIZE * 4  # fp32 MHA, the largest case
    k_pool, v_pool = Pool(pool_bytes, huge=True), Pool(pool_bytes, huge=True)
    read = zeros_huge_pages((1 << 28,), torch.float32).normal_()
    read_bytes = read.numel() * 4
    results: Dict[str, object] = {"isa": pa.cpu_isa(), "library": pa.__file__, "source": source_revision()}

    def fill(name: str) -> None:
        k_pool.fill(random_pattern(DTYPES[name], 1))
        v_pool.fill(random_pattern(DTYPES[name], 2))

    for name in DTYPES:
        fill(name)
        for kv_heads in KV_HEADS:
            dram = decode_case(k_pool, v_pool, name, BATCH, kv_heads, CONTEXT, BLOCK_SIZE)
            s = time_interleaved_samples({"paged": dram.run, "read": read.sum}, 2, reps)
            paged_rates = [dram.kv_bytes / t / 1e9 for t in s["paged"]]
            ref = [read_bytes / t / 1e9 for t in s["read"]]
            results[f"dram {name} 32/{kv_heads}"] = {
                "gbps": statistics.median(paged_rates), "read_gbps": statistics.median(ref),
                "pct_of_read": 100 * statistics.median(a / b for a, b in zip(paged_rates, ref))}
            # Back to back: after the 1 GiB read the cache would be cold.
            l3 = cache_resident(decode_case(k_pool, v_pool, name, BATCH, kv_heads, L3_CONTEXT,
                                            BLOCK_SIZE))
            for level, case in (("l3", l3), ("l2", core_resident(dram))):
                s = time_interleaved_samples({"paged": case.run}, 2, reps)
                results[f"{level} {name} 32/{kv_heads}"] = {
                    "gbps": statistics.median(case.kv_bytes / t / 1e9 for t in s["paged"])}
    for name in MT_DTYPES:
        fill(name)
        case = multi_token_case(k_pool, v_pool, name)
        s = time_interleaved_samples({"paged": case.run}, 1, max(3, reps // 3))
        results[f"multi-token {name} 32/{MT_KV_HEADS}"] = {
            "gflops": case.flops / statistics.median(s["paged"]) / 1e9}
    return results


def kernels_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    summary = {}
    for key, first in rounds[0]["current"].items():
        if not isinstance(first, dict):
            continue
        metric = "gflops" if "gflops" in first else "gbps"
        both = paired(rounds, lambda w: w[key][metric])
        row = {f"current_{metric}": both["current"], f"baseline_{metric}": both["baseline"],
               "speedup_paired": both["speedup_paired"]}
        if "pct_of_read" in first:
            row["current_pct_of_read"] = statistics.median(r["current"][key]["pct_of_read"] for r in rounds)
            row["baseline_pct_of_read"] = statistics.median(r["baseline"][key]["pct_of_read"] for r in rounds)
            # The host's read bandwidth may have two states; compare builds within each.
            for state, in_state in (("fast", lambda x: x > FAST_READ_GBPS),
                                    ("slow", lambda x: x <= FAST_READ_GBPS)):
                same = [r for r in rounds
                        if all(in_state(r[b][key]["read_gbps"]) for b in ("current", "baseline"))]
                if same:
                    row[f"{state}_rounds"] = len(same)
                    row[f"{state}_current_gbps"] = statistics.median(r["current"][key]["gbps"] for r in same)
                    row[f"{state}_baseline_gbps"] = statistics.median(r["baseline"][key]["gbps"] for r in same)
        summary[key] = row
    print(f"{'configuration':28s} {'baseline':>10s} {'current':>10s} {'speedup':>8s}   % of read (base -> cur)")
    for key, row in summary.items():
        unit = "gflops" if "current_gflops" in row else "gbps"
        pct = (f"   {row['baseline_pct_of_read']:4.0f}% -> {row['current_pct_of_read']:4.0f}%"
               if "current_pct_of_read" in row else "")
        states = "".join(
            f" | {st} ({row[f'{st}_rounds']}): {row[f'{st}_baseline_gbps']:.1f} -> {row[f'{st}_current_gbps']:.1f}"
            for st in ("fast", "slow") if f"{st}_rounds" in row)
        print(f"{key:28s} {row[f'baseline_{unit}']:10.1f} {row[f'current_{unit}']:10.1f} "
              f"{row['speedup_paired']:7.2f}x{pct}{states}")
    return {"suite": "kernels", "baseline": str(args.baseline), "rounds": rounds, "summary": summary,
            "units": "gbps = effective KV GB/s; gflops = multi-token GFLOP/s"}


# --- multi-token -----------------------------------------------------------------------

MT_SEQ_LEN, MT_QUERIES, MT_HEADS, MT_KV_HEADS, MT_HEAD_SIZE, MT_BLOCK = 4096, 512, 32, 8, 128, 16
MT_WINDOW, MT_SOFT_CAP = 1024, 50.0


def multi_token_worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from common.timing import time_interleaved_samples
    from common.token_caches import random_cache, random_scales
    from paged_attention_ext.token_quantization import stored_head_size

    torch.set_num_threads(2)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    gen = torch.Generator().manual_seed(0)
    num_blocks = MT_SEQ_LEN // MT_BLOCK
    table = torch.randperm(num_blocks, dtype=torch.int32, generator=gen).view(1, -1)
    lens = torch.tensor([MT_SEQ_LEN], dtype=torch.int32)
    starts = torch.tensor([0, MT_QUERIES], dtype=torch.int32)
    modifier = os.environ.get("AB_MULTI_TOKEN_MODIFIER", "")
    window = MT_WINDOW if modifier == "window" else -1
    alibi = torch.rand(MT_HEADS, generator=gen) * 0.1 if modifier == "alibi" else None
    soft_cap = MT_SOFT_CAP if modifier == "soft-cap" else 0.0
    seen = [MT_SEQ_LEN - MT_QUERIES + i + 1 for i in range(MT_QUERIES)]
    pairs = sum(min(n, MT_WINDOW) if window > 0 else n for n in seen)
    flops = 4 * MT_HEADS * MT_HEAD_SIZE * pairs
    calls = {}

    def call(q, k, v, scales):
        return lambda: pa.attention(q, k, v, table, lens, MT_HEAD_SIZE ** -0.5, starts, alibi_slopes=alibi,
                                    sliding_window=window, soft_cap=soft_cap, **scales)

    for name, dtype in dtypes.items():
        shape = (num_blocks, MT_KV_HEADS, MT_BLOCK, MT_HEAD_SIZE)
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        q = torch.randn(MT_QUERIES, MT_HEADS, MT_HEAD_SIZE, generator=gen).to(
            torch.bfloat16 if dtype.itemsize == 1 else dtype)
        scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}
        calls[name] = call(q, k, v, scales)
    # Per-token int8 and int4 rows.
    for name, dtype in {"int8": torch.int8, "int4": torch.uint8}.items():
        shape = (num_blocks, MT_KV_HEADS, MT_BLOCK, stored_head_size(dtype, MT_HEAD_SIZE))
        k, v = random_cache(dtype, shape, gen), random_cache(dtype, shape, gen)
        scales = {which: random_scales(dtype, num_blocks, MT_KV_HEADS, MT_BLOCK, gen)
                  for which in ("k_scale", "v_scale")}
        q = torch.randn(MT_QUERIES, MT_HEADS, MT_HEAD_SIZE, generator=gen).to(torch.bfloat16)
        calls[name] = call(q, k, v, scales)
    samples = time_interleaved_samples(calls, warmup=1, reps=reps)
    return {"isa": pa.cpu_isa(), "library": pa.__file__, "modifier": modifier or "none",
            "gflops": {name: flops / min(t) / 1e9 for name, t in samples.items()}}


def multi_token_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    summary = {}
    print(f"{'dtype':6s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}  vs fp32 (base -> cur)")
    for name in rounds[0]["current"]["gflops"]:
        def vs_fp32(build: str) -> float:
            return statistics.median(r[build]["gflops"][name] / r[build]["gflops"]["fp32"] for r in rounds)

        both = paired(rounds, lambda w: w["gflops"][name])
        row = {"baseline_gflops": both["baseline"], "current_gflops": both["current"],
               "speedup_paired": both["speedup_paired"],
               "baseline_vs_fp32": vs_fp32("baseline"), "current_vs_fp32": vs_fp32("current")}
        summary[name] = row
        print(f"{name:6s} {row['baseline_gflops']:9.1f} {row['current_gflops']:9.1f} "
              f"{row['speedup_paired']:7.2f}x  {row['baseline_vs_fp32']:.2f}x -> {row['current_vs_fp32']:.2f}x")
    return {"suite": "multi-token", **source_and_cpu(), "isa": rounds[0]["current"]["isa"],
            "modifier": rounds[0]["current"].get("modifier", "none"),
            "baseline": str(args.baseline), "rounds": rounds, "summary": summary}


# --- amx -------------------------------------------------------------------------------

AMX_HEAD, AMX_BLOCK = 128, 16
AMX_DECODE = [(16, 8, 2048), (32, 8, 2048), (32, 4, 8192), (32, 1, 8192)]


def amx_worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from common.timing import time_interleaved_samples
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    caches = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    shapes = [(f"decode {h}/{kv} ctx {n}", h, kv, [n] * 16, [1] * 16) for h, kv, n in AMX_DECODE]
    shapes.append(("multi-token 32/8 512/4096", 32, 8, [4096], [512]))
    gen = torch.Generator().manual_seed(0)
    huge = os.environ.get("AB_AMX_HUGE_PAGES") == "1"

    def pool(values: torch.Tensor) -> torch.Tensor:
        return zeros_huge_pages(values.shape, values.dtype).copy_(values) if huge else values
    calls, work = {}, {}
    for cache, dtype in caches.items():
        for label, heads, kv_heads, lens, q_lens in shapes:
            blocks = sum(-(-n // AMX_BLOCK) for n in lens)
            shape = (blocks, kv_heads, AMX_BLOCK, AMX_HEAD)
            k = pool(torch.randn(shape, generator=gen).to(dtype))
            v = pool(torch.randn(shape, generator=gen).to(dtype))
            table = torch.randperm(blocks, generator=gen).to(torch.int32).view(len(lens), -1)
            q = torch.randn(sum(q_lens), heads, AMX_HEAD, generator=gen).to(torch.bfloat16)
            kwargs = {} if dtype == torch.bfloat16 else {"k_scale": torch.tensor(1.0),
                                                         "v_scale": torch.tensor(1.0)}
            if max(q_lens) > 1:
                starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
                kwargs["query_start_loc"] = torch.tensor(starts, dtype=torch.int32)
            call_args = (q, k, v, table, torch.tensor(lens, dtype=torch.int32), AMX_HEAD ** -0.5)
            name = f"{cache} {label}"
            calls[name] = lambda call_args=call_args, kwargs=kwargs: pa.attention(*call_args, **kwargs)
            if max(q_lens) > 1:
                pairs = sum(sum(n - m + i + 1 for i in range(m)) for n, m in zip(lens, q_lens))
                work[name] = (4 * heads * AMX_HEAD * pairs, "GFLOP/s")
            else:
                work[name] = (2 * k.numel() * k.element_size(), "GB/s")
    words = [w for w in os.environ.get("AB_AMX_CASES", "").split(",") if w]
    calls = {name: call for name, call in calls.items() if all(w in name for w in words)}
    samples = time_interleaved_samples(calls, warmup=1, reps=reps)
    return {"isa": pa.cpu_isa(), "library": pa.__file__,
            "rates": {name: work[name][0] / min(t) / 1e9 for name, t in samples.items()},
            "units": {name: work[name][1] for name in calls}}


def amx_setup(args: argparse.Namespace) -> None:
    """The options reach the workers as environment variables."""
    if args.cases is not None:
        os.environ["AB_AMX_CASES"] = args.cases
    if args.huge_pages:
        os.environ["AB_AMX_HUGE_PAGES"] = "1"
    os.environ["PAGED_ATTENTION_CPU_ISA"] = args.isa or os.environ.get("AB_AMX_ISA", "amx")


def amx_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    isa = os.environ["PAGED_ATTENTION_CPU_ISA"]
    if rounds[0]["current"]["isa"] != isa:
        raise SystemExit(f"this CPU's kernel is {rounds[0]['current']['isa']}: no {isa} to measure")
    summary = {}
    print(f"{'case':42s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}")
    for name, unit in rounds[0]["current"]["units"].items():
        row = {"unit": unit, **paired(rounds, lambda w: w["rates"][name])}
        summary[name] = row
        low, high = row["speedup_range"]
        print(f"{name:42s} {row['baseline']:9.1f} {row['current']:9.1f} {row['speedup_paired']:7.2f}x"
              f"  ({low:.2f}-{high:.2f}) {unit}")
    return {"suite": "amx", **source_and_cpu(), "isa": rounds[0]["current"]["isa"],
            "huge_pages": os.environ.get("AB_AMX_HUGE_PAGES") == "1",
            "baseline": str(args.baseline), "rounds": rounds, "summary": summary}


# --- isa-matrix ------------------------------------------------------------------------

def isa_matrix_worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from common.environment import source_revision
    from common.timing import time_interleaved_samples
    from cpu_perf.config import BATCH, BLOCK_SIZE, CONTEXT, KV_HEADS
    from cpu_perf.isa_matrix import DTYPES, DecodeCandidate, supported_isas
    from cpu_perf.machine import with_isa

    torch.set_num_threads(2)
    isas = os.environ["AB_ISA"].split(",") if os.environ.get("AB_ISA") else supported_isas()
    rates: Dict[str, float] = {}
    for kv_heads in KV_HEADS:
        blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
        gen = torch.Generator().manual_seed(kv_heads)
        table = torch.randperm(BATCH * blocks_per_seq, generator=gen, dtype=torch.int32).view(BATCH, -1)
        cases = {name: DecodeCandidate(name, kv_heads, table, seed=10 * i) for i, name in enumerate(DTYPES)}
        for level, tables in (("dram", lambda c: c.table), ("l2", lambda c: c.l2_table)):
            calls = {f"{level} {isa} {name} 32/{kv_heads}":
                     with_isa(isa, lambda case=case: case.run(tables(case)))
                     for isa in isas for name, case in cases.items()}
            samples = time_interleaved_samples(calls, 1, reps)
            for key, t in samples.items():
                case = cases[key.split()[2]]
                rates[key] = case.kv_bytes / statistics.median(t) / 1e9
        del cases
    return {"isa": pa.cpu_isa(), "isas": isas, "library": pa.__file__, "source": source_revision(),
            "rates": rates}


def sign_tested_rows(rounds: Rounds, key: str, label: str, width: int) -> Dict[str, Dict[str, object]]:
    """Each row of the workers' ``key`` results: paired medians, the rounds in which the current
    build was faster and a sign test over them, printed as a table."""
    summary = {}
    print(f"{label:{width}s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}  range        rounds faster  p")
    for name in rounds[0]["current"][key]:
        row = paired(rounds, lambda w, n=name: w[key][n])
        row["rounds_faster"] = sum(r["current"][key][name] > r["baseline"][key][name] for r in rounds)
        row["sign_test_p"] = sign_test_p(row["rounds_faster"], len(rounds))
        summary[name] = row
        low, high = row["speedup_range"]
        print(f"{name:{width}s} {row['baseline']:9.1f} {row['current']:9.1f} {row['speedup_paired']:7.3f}x"
              f"  ({low:.2f}-{high:.2f})  {row['rounds_faster']:>2d}/{len(rounds)}  {row['sign_test_p']:.3f}")
    return summary


def isa_matrix_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    summary = sign_tested_rows(rounds, "rates", "row", 34)
    above = sum(row["speedup_paired"] > 1 for row in summary.values())
    below = sum(row["speedup_paired"] < 1 for row in summary.values())
    print(f"rows faster / slower (median paired ratio): {above} / {below}")
    # The current worker's build: this process may import another copy of the package.
    return {"suite": "isa-matrix", **source_and_cpu(), "source": rounds[0]["current"]["source"],
            "isas": rounds[0]["current"]["isas"],
            "baseline": str(args.baseline), "rounds": rounds, "summary": summary,
            "rows_faster": above, "rows_slower": below, "units": "GB/s of KV"}


def sign_test_p(faster: int, rounds: int) -> float:
    """Two-sided sign test: how likely a split of the rounds at least this uneven is by chance."""
    import math

    k = min(faster, rounds - faster)
    return min(1.0, 2 * sum(math.comb(rounds, i) for i in range(k + 1)) / 2 ** rounds) if rounds else 1.0


def isa_matrix_setup(args: argparse.Namespace) -> None:
    if args.isa:
        os.environ["AB_ISA"] = args.isa


# --- shared-prefix ---------------------------------------------------------------------

SP_HEADS, SP_HEAD_SIZE, SP_BLOCK = 32, 128, 16
SP_GROUPS = ((8, 4096), (16, 2048))  # (query rows, prefix tokens)


def shared_prefix_worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from common.timing import time_interleaved_samples

    torch.set_num_threads(2)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    gen = torch.Generator().manual_seed(0)
    words = [w for w in os.environ.get("AB_SHARED_PREFIX_CASES", "").split(",") if w]
    calls, flops = {}, {}
    for kv_heads in (8, 32):
        for name, dtype in dtypes.items():
            for rows, prefix in SP_GROUPS:
                blocks = prefix // SP_BLOCK
                shape = (blocks, kv_heads, SP_BLOCK, SP_HEAD_SIZE)
                k = torch.randn(shape, generator=gen).to(dtype)
                v = torch.randn(shape, generator=gen).to(dtype)
                q = torch.randn(rows, SP_HEADS, SP_HEAD_SIZE, generator=gen).to(
                    torch.bfloat16 if dtype.itemsize == 1 else dtype)
                table = torch.randperm(blocks, dtype=torch.int32, generator=gen).view(1, -1)
                lens = torch.tensor([prefix], dtype=torch.int32)
                starts = torch.tensor([0, rows], dtype=torch.int32)
                scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}
                caps = (0.0, 30.0) if (name, kv_heads) == ("bf16", 8) else (0.0,)
                for cap in caps:
                    key = f"{name} 32/{kv_heads} {rows}x{prefix}" + (" soft cap" if cap else "")
                    if not all(word in key for word in words):
                        continue
                    calls[key] = lambda q=q, k=k, v=v, table=table, lens=lens, starts=starts, scales=scales, cap=cap: \
                        pa.shared_prefix_attention(q, k, v, table, lens, starts, SP_HEAD_SIZE ** -0.5,
                                                   soft_cap=cap, **scales)
                    flops[key] = 4 * SP_HEADS * SP_HEAD_SIZE * rows * prefix
    samples = time_interleaved_samples(calls, warmup=1, reps=reps)
    return {"isa": pa.cpu_isa(), "library": pa.__file__,
            "gflops": {key: flops[key] / min(t) / 1e9 for key, t in samples.items()}}


def multi_token_setup(args: argparse.Namespace) -> None:
    isa_setup(args)
    if args.modifier is not None:
        os.environ["AB_MULTI_TOKEN_MODIFIER"] = args.modifier


def shared_prefix_setup(args: argparse.Namespace) -> None:
    isa_setup(args)
    if args.cases is not None:
        os.environ["AB_SHARED_PREFIX_CASES"] = args.cases


def shared_prefix_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    summary = sign_tested_rows(rounds, "gflops", "case", 28)
    return {"suite": "shared-prefix", **source_and_cpu(), "isa": rounds[0]["current"]["isa"],
            "baseline": str(args.baseline), "rounds": rounds, "summary": summary, "units": "GFLOP/s"}


# --- decode-context --------------------------------------------------------------------

CONTEXTS = (256, 512, 2048, 16384)
DC_KV_BYTES, DC_HEADS, DC_KV_HEADS, DC_HEAD, DC_BLOCK = 1 << 30, 32, 8, 128, 16


def decode_context_worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from common.timing import time_call
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    tokens = DC_KV_BYTES // (2 * DC_KV_HEADS * DC_HEAD * 2)
    blocks = tokens // DC_BLOCK
    calls = {}
    for context in CONTEXTS:
        batch = tokens // context
        k = zeros_huge_pages((blocks, DC_KV_HEADS, DC_BLOCK, DC_HEAD), torch.bfloat16)
        v = zeros_huge_pages((blocks, DC_KV_HEADS, DC_BLOCK, DC_HEAD), torch.bfloat16)
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, -1)
        q = torch.randn(batch, DC_HEADS, DC_HEAD, generator=gen).to(torch.bfloat16)
        lens = torch.full((batch,), context, dtype=torch.int32)
        calls[context] = lambda q=q, k=k, v=v, table=table, lens=lens: pa.attention(
            q, k, v, table, lens, DC_HEAD ** -0.5)
    flush = zeros_huge_pages((DC_KV_BYTES // 4,), torch.float32).fill_(1.0)
    samples: Dict[int, List[float]] = {context: [] for context in CONTEXTS}
    for call in calls.values():
        call()
    for rep in range(reps):
        shift = rep % len(CONTEXTS)
        for context in CONTEXTS[shift:] + CONTEXTS[:shift]:
            flush.sum()
            samples[context].append(time_call(calls[context]))
    return {"isa": pa.cpu_isa(), "rates": {str(c): DC_KV_BYTES / min(t) / 1e9 for c, t in samples.items()}}


def decode_context_report(rounds: Rounds, args: argparse.Namespace) -> Dict[str, object]:
    summary = {}
    print(f"{'context':>8s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}  (GB/s of KV)")
    for context in CONTEXTS:
        row = paired(rounds, lambda w, c=str(context): w["rates"][c])
        summary[str(context)] = row
        low, high = row["speedup_range"]
        print(f"{context:8d} {row['baseline']:9.1f} {row['current']:9.1f} {row['speedup_paired']:7.2f}x"
              f"  ({low:.2f}-{high:.2f})")
    return {"suite": "decode-context", **source_and_cpu(), "isa": rounds[0]["current"]["isa"],
            "baseline": str(args.baseline), "rounds": rounds, "summary": summary}


# --- the command line ------------------------------------------------------------------

class Suite:
    def __init__(self, help: str, default_reps: int, out: str, worker: Callable[[int], Dict[str, object]],
                 report: Callable[[Rounds, argparse.Namespace], Dict[str, object]],
                 setup: Callable[[argparse.Namespace], None] = lambda args: None):
        self.help, self.default_reps, self.out = help, default_reps, RESULTS / out
        self.worker, self.report, self.setup = worker, report, setup


def isa_setup(args: argparse.Namespace) -> None:
    if args.isa:
        os.environ["PAGED_ATTENTION_CPU_ISA"] = args.isa


SUITES = {
    "kernels": Suite("decode from DRAM, L3 and L2; multi-token fp32 and bf16", 12,
                     "cpu_kernel_ab.json", kernels_worker, kernels_report),
    "multi-token": Suite("causal multi-token, every cache dtype", 4,
                         "cpu_multi_token_ab.json", multi_token_worker, multi_token_report, multi_token_setup),
    "amx": Suite("the amx kernel's shapes: grouped decode and multi-token, bf16 and e4m3", 5,
                 "cpu_amx_ab.json", amx_worker, amx_report, amx_setup),
    "isa-matrix": Suite("bench_cpu_perf's isa_matrix decode rows: every kernel x cache dtype, DRAM and L2", 5,
                        "cpu_isa_matrix_ab.json", isa_matrix_worker, isa_matrix_report, isa_matrix_setup),
    "shared-prefix": Suite("shared_prefix_attention (queries in lanes), every cache dtype", 5,
                           "cpu_shared_prefix_ab.json", shared_prefix_worker, shared_prefix_report,
                           shared_prefix_setup),
    "decode-context": Suite("bf16 32/8 decode at contexts 256 to 16384, caches flushed", 8,
                            "cpu_decode_context_ab.json", decode_context_worker, decode_context_report),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, suite in SUITES.items():
        sub = suites.add_parser(name, help=suite.help, description=suite.help)
        add_ab_arguments(sub, suite.default_reps, suite.out)
        if name in ("multi-token", "amx", "isa-matrix", "shared-prefix"):
            sub.add_argument("--isa", help="the kernels to time, comma-separated (default: every one "
                             "the CPU runs)" if name == "isa-matrix" else "PAGED_ATTENTION_CPU_ISA for both builds")
        if name == "multi-token":
            sub.add_argument("--modifier", choices=("window", "alibi", "soft-cap"),
                             help="a sliding window of %d keys, ALiBi slopes or a soft cap of %g (default: "
                             "causal alone)" % (MT_WINDOW, MT_SOFT_CAP))
        if name in ("amx", "shared-prefix"):
            sub.add_argument("--cases", help="comma-separated words every timed case's name contains")
            sub.add_argument("--huge-pages", action="store_true", help="caches on huge pages")
    args = parser.parse_args()
    suite = SUITES[args.suite]
    if not args.worker:
        suite.setup(args)
    rounds = ab_rounds(suites.choices[args.suite], args, [str(Path(__file__).resolve()), args.suite],
                       suite.worker)
    if rounds is None:
        return
    write_report(args.out, suite.report(rounds, args))


if __name__ == "__main__":
    main()
