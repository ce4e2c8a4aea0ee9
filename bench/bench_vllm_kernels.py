"""Attention kernels side by side: ``torch.ops.paged.attention`` against vLLM's CPU kernel
(``torch.ops._C.cpu_attention_with_kv_cache``) and, with ``--peers vllm,sdpa``, torch's
``scaled_dot_product_attention`` on the same keys, values, queries and block tables, in one
process (on AMX CPUs our tile kernel against vLLM's).

Usage (in the vLLM environment, ``make .venv-vllm/.installed``)::

    .venv-vllm/bin/python bench/bench_vllm_kernels.py [--quick] [--vllm-isa amx] --out PATH
    # the CPU peers table: fp32 and bf16 caches, decode only, one 32k-token sequence too
    .venv-vllm/bin/python bench/bench_vllm_kernels.py --vllm-isa vec --peers vllm,sdpa \
        --caches fp32,bf16 --cases decode --long-context 32768 --out PATH

``PATH`` is per CPU: ``bench/results/vllm_kernels_<cpu>.json`` (e.g. ``intel_amx``,
``amd_epyc_zen4``).

Method
------
* Cases: decode (B=16, context 2048; 32/32 and 32/8 heads; with ``--long-context N`` also
  B=1, context N) and a causal multi-token chunk (512 queries at the end of 4096 tokens,
  32/8 heads), head size 128, blocks of 32 and 128 tokens (vLLM's kernels take multiples of
  32), caches (``--caches``) fp32, bf16 and, where vLLM takes it, fp8 e4m3 (scales 1).
  Queries are fp32 over an fp32 cache (both sides take them), bf16 otherwise.
* SDPA (decode rows of 16- and 32-bit caches; it has no paged or fp8 input) reads
  contiguous ``[B, kv_heads, context, 128]`` keys and values of the same tokens, with
  ``enable_gqa`` for grouped heads, and allocates its own output: what attention costs
  without a paged cache.
* Each side has its own cache in its own layout, written by its own cache op
  (``paged.write_kv`` into HND; vLLM's ``cpu_attn_reshape_and_cache`` into its layout for
  the ISA, which for ``amx`` packs the tiles at write time) from the same tokens, under the
  same random physical block order. vLLM's scheduler metadata is built once per case
  outside the timed call (as its backend does once per step); ours plans inside the call.
  Ours and vLLM's write into an output allocated once (``paged.attention_out``, as our vLLM
  backend calls it).
* Every peer's output is compared with ours first (a case that disagrees stops the run).
  Then the calls alternate, ``--rounds`` rounds of one call each after a warm-up; a peer's
  speedup is the median over rounds of its time / ours in the same round, and
  ``<peer>_over_ours`` the inverse (the peer's speed as a share of ours).
* Before every timed call a 1 GiB sum (timed on its own, on huge pages as isa_matrix
  reads) flushes the caches, so every side reads its KV from DRAM, and gives the read
  bandwidth of that round: decode rows carry each side's rate (the cache's bytes, SDPA's
  too) as a share of it (median over rounds of the paired ratio), how far a memory-bound
  side is from the read. Each side's KV is on 4 KiB pages, as vLLM allocates its own, or
  with ``--huge-pages`` on huge pages.
* The host: CPU model, family / model and the flags that matter, torch threads, our ISA
  (``paged_attention_ext.cpu_isa()``) and vLLM's, recorded in the JSON.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paged_attention_ext as pa  # noqa: E402
from paged_attention_ext.host_memory import zeros_huge_pages  # noqa: E402
from common.environment import cpu_details, cpu_model  # noqa: E402
from common.timing import time_call  # noqa: E402

HEAD = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
FP8 = {"fp32": None, "bf16": None, "e4m3": "fp8_e4m3"}  # vLLM's kv_cache_dtype, None: "auto"
READ_BYTES = 1 << 30  # the read that flushes the caches before each call


def vllm_ops():
    import vllm._custom_ops as ops  # noqa: F401  (registers torch.ops._C)
    return ops


class Case:
    def __init__(self, name: str, cache: str, lens: List[int], q_lens: List[int], heads: int,
                 kv_heads: int, block_size: int, vllm_isa: str, huge_pages: bool,
                 peers: List[str], seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.name, self.cache, self.block_size = name, cache, block_size
        self.heads, self.kv_heads = heads, kv_heads
        blocks = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks)
        physical = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        first = 0
        for i, nb in enumerate(blocks):
            self.block_tables[i, :nb] = physical[first:first + nb]
            first += nb
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                            dtype=torch.int32)
        dtype = DTYPES[cache]
        token_dtype = torch.float32 if cache == "fp32" else torch.bfloat16
        self.query = torch.randn(sum(q_lens), heads, HEAD, generator=gen).to(token_dtype)
        self.multi_token = max(q_lens) > 1
        self.kv_bytes = sum(lens) * kv_heads * HEAD * 2 * dtype.itemsize
        self.flops = 4 * heads * HEAD * sum(
            sum(n - q + i + 1 for i in range(q)) for n, q in zip(lens, q_lens))
        self.peers = [p for p in peers
                      if p == "vllm" or (p == "sdpa" and not self.multi_token and not FP8[cache])]

        # Ours: HND caches.
        shape = (num_blocks, kv_heads, block_size, HEAD)
        zeros = zeros_huge_pages if huge_pages else (lambda size, dtype: torch.zeros(size, dtype=dtype))
        self.key_cache = zeros(shape, dtype)
        self.value_cache = zeros(shape, dtype)
        self.scales = ({"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)}
                       if FP8[cache] else {})
        self.ours_out = torch.empty_like(self.query)
        if "vllm" in self.peers:
            ops = vllm_ops()
            # vLLM: [num_blocks, kv_heads, block_size, 2 * head] viewed as keys then values.
            joint = zeros((num_blocks, kv_heads, block_size, 2 * HEAD),
                          torch.uint8 if FP8[cache] else dtype)
            self.vllm_key, self.vllm_value = joint.view(num_blocks, kv_heads, 2 * block_size,
                                                        HEAD).chunk(2, dim=2)
            self.vllm_out = torch.empty_like(self.query)
        if "sdpa" in self.peers:  # decode only: every sequence has the same length
            self.sdpa_key = zeros((len(lens), kv_heads, lens[0], HEAD), dtype)
            self.sdpa_value = zeros((len(lens), kv_heads, lens[0], HEAD), dtype)
        for i, n in enumerate(lens):
            key = torch.randn(n, kv_heads, HEAD, generator=gen).to(token_dtype)
            value = torch.randn(n, kv_heads, HEAD, generator=gen).to(token_dtype)
            pos = torch.arange(n)
            slots = (self.block_tables[i, pos // block_size].long() * block_size
                     + pos % block_size)
            pa.write_kv(key, value, self.key_cache, self.value_cache, slots, **self.scales)
            if "vllm" in self.peers:
                ops.cpu_attn_reshape_and_cache(key, value, self.vllm_key, self.vllm_value, slots,
                                               vllm_isa, kv_cache_dtype=FP8[cache] or "auto")
            if "sdpa" in self.peers:
                self.sdpa_key[i] = key.transpose(0, 1)
                self.sdpa_value[i] = value.transpose(0, 1)
        if "vllm" in self.peers:
            self.metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD,
                seq_lens=self.seq_lens, dtype=token_dtype, query_start_loc=self.query_start_loc,
                causal=True, sliding_window_size=-1, isa=vllm_isa, enable_kv_split=True,
                kv_cache_dtype=FP8[cache] or "auto")

    def calls(self) -> Dict[str, Callable[[], torch.Tensor]]:
        return {"ours": self.ours, **{p: getattr(self, p) for p in self.peers}}

    def ours(self) -> torch.Tensor:
        qsl = self.query_start_loc if self.multi_token else None
        return pa.attention_out(self.ours_out, self.query, self.key_cache, self.value_cache,
                                self.block_tables, self.seq_lens, HEAD ** -0.5, query_start_loc=qsl,
                                **self.scales)

    def vllm(self) -> torch.Tensor:
        ops = vllm_ops()
        ops.cpu_attention_with_kv_cache(
            query=self.query, key_cache=self.vllm_key, value_cache=self.vllm_value,
            output=self.vllm_out, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            scale=HEAD ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.block_tables, softcap=0.0, scheduler_metadata=self.metadata,
            s_aux=None, kv_cache_dtype=FP8[self.cache] or "auto")
        return self.vllm_out

    def sdpa(self) -> torch.Tensor:
        out = F.scaled_dot_product_attention(self.query.unsqueeze(2), self.sdpa_key, self.sdpa_value,
                                             scale=HEAD ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        return out.squeeze(2)

    def describe(self) -> Dict[str, object]:
        return {"case": self.name, "cache": self.cache, "heads": self.heads,
                "kv_heads": self.kv_heads, "block_size": self.block_size,
                "kv_bytes": self.kv_bytes, "flops": self.flops}


def cases(quick: bool, vllm_isa: str, caches: List[str], huge_pages: bool, long_context: int,
          peers: List[str]):
    batch, context = (4, 1024) if quick else (16, 2048)
    mt_q, mt_len = (128, 1024) if quick else (512, 4096)
    for block_size in (32, 128):
        for cache in caches:
            decode = [(batch, context)] + ([(1, long_context)] if long_context else [])
            for b, n in decode:
                for kv_heads in (32, 8):
                    yield (f"decode B={b} ctx={n}", cache, [n] * b, [1] * b,
                           32, kv_heads, block_size, vllm_isa, huge_pages, peers)
            yield (f"multi-token {mt_q} causal over {mt_len}", cache, [mt_len], [mt_q], 32, 8,
                   block_size, vllm_isa, huge_pages, peers)


def time_rounds(case: Case, rounds: int, read: torch.Tensor) -> Dict[str, object]:
    calls = case.calls()
    for fn in calls.values():
        fn()
    seconds: Dict[str, List[float]] = {k: [] for k in calls}
    read_before: Dict[str, List[float]] = {k: [] for k in calls}  # the read (and flush) before each call
    for _ in range(rounds):
        for name, fn in calls.items():
            read_before[name].append(time_call(read.sum))
            seconds[name].append(time_call(fn))
    ours = statistics.median(seconds["ours"])
    row = {**case.describe(), "ours_ms": round(ours * 1e3, 3),
           "read_gbps": round(READ_BYTES / statistics.median(sum(read_before.values(), [])) / 1e9, 1)}
    for peer in case.peers:
        ratios = [p / o for p, o in zip(seconds[peer], seconds["ours"])]
        row[f"{peer}_ms"] = round(statistics.median(seconds[peer]) * 1e3, 3)
        row[f"speedup_over_{peer}"] = round(statistics.median(ratios), 3)
        row[f"speedup_over_{peer}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        row[f"{peer}_over_ours"] = round(statistics.median([1 / r for r in ratios]), 3)
    for name in calls:
        median = statistics.median(seconds[name])
        if case.multi_token:
            row[f"{name}_gflops"] = round(case.flops / median / 1e9, 1)
        else:
            row[f"{name}_gbps"] = round(case.kv_bytes / median / 1e9, 1)
            # each call's rate against the read just before it
            shares = [case.kv_bytes * r / (READ_BYTES * c) for r, c in zip(read_before[name], seconds[name])]
            row[f"{name}_pct_of_read"] = round(100 * statistics.median(shares), 1)
    return row


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--vllm-isa", default="amx")
    parser.add_argument("--caches", default="bf16,e4m3", help="of fp32, bf16, e4m3")
    parser.add_argument("--peers", default="vllm", help="of vllm, sdpa")
    parser.add_argument("--cases", default="", help="only cases whose name contains this")
    parser.add_argument("--long-context", type=int, default=0,
                        help="also decode one sequence of this many tokens")
    parser.add_argument("--huge-pages", action="store_true",
                        help="both sides' caches on huge pages (default: 4 KiB pages, as vLLM allocates)")
    parser.add_argument("--out", required=True, help="e.g. bench/results/vllm_kernels_<cpu>.json")
    args = parser.parse_args(argv)
    peers, caches = args.peers.split(","), args.caches.split(",")
    # A misspelt name would otherwise drop its rows without a word.
    if set(peers) - {"vllm", "sdpa"}:
        parser.error(f"--peers takes vllm and sdpa; got {args.peers!r}")
    if set(caches) - set(DTYPES):
        parser.error(f"--caches takes {', '.join(DTYPES)}; got {args.caches!r}")
    rows = []
    read = zeros_huge_pages((READ_BYTES // 4,), torch.float32)
    for spec in cases(args.quick, args.vllm_isa, caches, args.huge_pages,
                      args.long_context, peers):
        if args.cases not in spec[0]:
            continue
        case = Case(*spec)
        if not case.peers:
            continue
        ours = case.ours().float()
        diffs = {f"{peer}_max_abs_difference": (ours - getattr(case, peer)().float()).abs().max().item()
                 for peer in case.peers}
        for name, diff in diffs.items():
            # Both round probabilities to bf16; fp8 rows also meet vLLM's own dequantization.
            if not diff < (1e-1 if FP8[case.cache] else 5e-2):
                raise SystemExit(f"{case.describe()}: {name} {diff}")
        row = {**time_rounds(case, 3 if args.quick else args.rounds, read), **diffs}
        rows.append(row)
        def rate(name: str) -> str:
            return (f"{row[f'{name}_gflops']} GFLOP/s" if case.multi_token else
                    f"{row[f'{name}_gbps']} GB/s ({row[f'{name}_pct_of_read']}% of read)")
        print(f"{row['case']:<22} {row['cache']:<4} {row['heads']}/{row['kv_heads']:<2} "
              f"block {row['block_size']:<3} ours {row['ours_ms']:.2f} ms {rate('ours')}"
              + "".join(f" | {p} {row[f'{p}_ms']:.2f} ms {rate(p)}, ours {row[f'speedup_over_{p}']:.2f}x "
                        f"({row[f'speedup_over_{p}_range'][0]:.2f}-{row[f'speedup_over_{p}_range'][1]:.2f})"
                        for p in case.peers)
              + f" | read {row['read_gbps']} GB/s", flush=True)
        del case
    report = {"what": __doc__.splitlines()[0], "cpu_model": cpu_model(), "cpu": cpu_details(),
              "machine": platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "ours_isa": pa.cpu_isa(),
              "peers": peers, "huge_pages": args.huge_pages,
              "loadavg": [round(x, 2) for x in os.getloadavg()],
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    if "vllm" in peers:
        import vllm
        report.update(vllm=vllm.__version__, vllm_isa=args.vllm_isa)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
