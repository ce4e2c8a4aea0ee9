"""GPU benchmark of the CUDA kernels: decode attention and the cache ops against the
device's copy bandwidth, SDPA on contiguous K/V, and FlexAttention's paged attention;
fp8 against bf16 caches and NHD against HND layouts.

Usage: ``python bench/bench_cuda.py [--out PATH] [--quick] [--budget-s S] [--device cpu]
[--only kv_formats]``
(``bench/gpu_check.sh`` runs it; ``--device cpu --quick`` is a smoke test of the script
itself on machines without a GPU, its numbers mean nothing).

Method
------
* Copy bandwidth: ``dst.copy_(src)`` of 2 GiB on the device, as bytes read plus written
  per second (median): the ceiling a streaming kernel can reach.
* Decode attention, bf16, head size 128, block size 16, 32 query heads over 8 KV heads
  (GQA) and 32 over 32 (MHA), batch 1/8/64/256, context 1k/4k/16k/64k, every sequence at
  full context. Configurations whose KV does not fit in 85% of free device memory are
  skipped, and a baseline is skipped where its extra copy of the KV does not fit.
  Candidates, on the same K/V values:

  - ``paged``: ``paged_attention_ext.attention`` over a block table that is a random
    permutation of the pool (the layout a long-running server ends up with);
  - ``sdpa``: ``F.scaled_dot_product_attention`` on the same K/V gathered into contiguous
    ``[batch, kv_heads, context, 128]`` tensors (``enable_gqa`` for GQA), query
    ``[batch, 32, 1, 128]``; the gather is not timed;
  - ``flex_paged``: ``flex_attention`` (compiled) with
    ``torch.nn.attention.experimental._paged_attention.PagedAttention``'s converted block
    mask and score mod over the same pages, where it runs; its compile time is excluded,
    and it runs on the configurations that fit in a time budget (compiling costs seconds
    per shape). If page size 16 fails, page size 128 is tried and recorded.

  Each baseline's output is compared with ``paged`` before timing. Effective KV bandwidth
  is the K and V bytes one decode step must read (``batch * context * kv_heads * 128 * 2 *
  2``) over the median time, also given as a percentage of the copy bandwidth.
* Cache ops (bf16, 8 KV heads, block size 16, head size 128): ``write_kv`` of 16384
  tokens into random slots, also quantized into a float8_e4m3fn cache; ``copy_blocks``
  of 1024 random pairs in 32 layers;
  ``swap_blocks`` of 2048 blocks device to pinned host, host to device, and device to
  device, with random and with consecutive block ids (one copy per run of adjacent
  blocks). Bandwidth counts bytes read plus written for device-only ops, bytes moved for
  transfers; the transfers are also compared with one plain pinned copy of the same bytes.
* Padded block tables (the CUDA-graph case: tables padded to a fixed width): the decode of ``paged`` at
  batch 1 and 64, 32/8 heads, 4k real context, with block tables 128k keys wide (the
  entries past the real blocks are padding), against the same call with a table of the
  real width.
* KV formats (fp8 caches and NHD views), first in the run: decode at head size 128, block size
  16, bf16 queries, on configurations of the fp8 target (batch >= 64, context >= 4k;
  32/8 and 32/32 heads): the bf16 cache (HND) against the same values quantized to
  float8_e4m3fn and float8_e5m2 with per-head scales (absmax / format max), and against
  NHD views (``cache.transpose(1, 2)`` of an NHD tensor) of the bf16 and the e4m3 cache,
  and the per-token int8 and int4 caches of the same values (``int8_token_hnd``,
  ``int4_token_hnd``). Each entry gives the median time, the effective bandwidth (bytes of
  the cache as stored, per-token scales included), ``speedup_vs_bf16`` (bf16 HND time over this time) and, for NHD,
  ``time_vs_hnd`` (over the same format's HND time). ``fp8_target`` says whether every
  fp8 row reached the 1.7x target. fp8 outputs are compared with bf16's (the quantization
  error, for information).
* Timing: CUDA events around each call, the L2 cache flushed before each (a 256 MiB
  write), warm-up calls first, the median of the repetitions.

Writes JSON (default ``bench/results/cuda.json``) after every phase and every decode
configuration, so a run cut short keeps what it measured, and prints a table. A case
that fails (a kernel error included) is recorded with its error, and the run goes on.
"""

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import paged_attention_ext as pa
from paged_attention_ext import token_quantization

HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
NUM_HEADS = 32
KV_HEADS = (8, 32)
BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 4096, 16384, 65536)
# FlexAttention compiles per shape: these configurations first, while its budget lasts.
FLEX_ORDER = [(8, 4096), (64, 4096), (1, 65536), (256, 1024), (8, 16384), (64, 16384),
              (1, 4096), (256, 4096)]


class Timer:
    """Median wall time of a call, with CUDA events and an L2 flush before each call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scrub = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn, reps: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.device.type != "cuda":
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
                continue
            self.scrub.fill_(1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 8 << 30
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / seconds / 1e9


def summary(seconds: float, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / seconds / 1e9
    return {"median_ms": seconds * 1e3, "gbps": gbps, "pct_of_copy": 100.0 * gbps / copy_gbps}


class DecodeCase:
    """A paged KV pool holding `batch` sequences of `context` tokens in random blocks."""

    def __init__(self, batch, context, kv_heads, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context, self.kv_heads = batch, context, kv_heads
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE)
        self.key_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
        self.value_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
        perm = torch.randperm(num_blocks, generator=gen, device=device)
        self.block_tables = perm.view(batch, blocks_per_seq).int()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, generator=gen, device=device, dtype=DTYPE)
        self.scale = HEAD_SIZE ** -0.5

    @property
    def kv_bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()

    def paged(self):
        return pa.attention(self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                            self.scale)

    def contiguous(self, cache):
        """[batch, kv_heads, context, head_size]: the sequences' rows in logical order."""
        rows = cache[self.block_tables.long()]  # [batch, blocks, kv_heads, block_size, head_size]
        return rows.permute(0, 2, 1, 3, 4).reshape(self.batch, self.kv_heads, self.context, HEAD_SIZE)


def sdpa_candidate(case: DecodeCase):
    k, v = case.contiguous(case.key_cache), case.contiguous(case.value_cache)
    q = case.query.unsqueeze(2)  # [batch, heads, 1, head_size]
    gqa = case.kv_heads != NUM_HEADS

    def run():
        return F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=gqa).squeeze(2)

    return run, (k, v)


def flex_candidate(case: DecodeCase, page_size: int):
    """flex_attention through torch's experimental PagedAttention, over pages of `page_size`."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    device = case.query.device
    k, v = case.contiguous(case.key_cache), case.contiguous(case.value_cache)
    pages_per_seq = case.context // page_size
    n_pages = case.batch * pages_per_seq
    perm = torch.randperm(n_pages, device=device)
    table = perm.view(case.batch, pages_per_seq)

    def pool(x):  # [1, kv_heads, n_pages * page_size, head_size], page `table[b, j]` = tokens j of b
        pages = x.view(case.batch, case.kv_heads, pages_per_seq, page_size, HEAD_SIZE)
        out = torch.empty(n_pages, case.kv_heads, page_size, HEAD_SIZE, dtype=x.dtype, device=device)
        out[table.reshape(-1)] = pages.permute(0, 2, 1, 3, 4).reshape(n_pages, case.kv_heads, page_size, HEAD_SIZE)
        return out.permute(1, 0, 2, 3).reshape(1, case.kv_heads, n_pages * page_size, HEAD_SIZE)

    k_pool, v_pool = pool(k), pool(v)
    del k, v
    paged = PagedAttention(n_pages, page_size, case.batch, device=str(device))
    paged.page_table[:, :pages_per_seq] = table
    logical = torch.arange(pages_per_seq, device=device).expand(case.batch, -1)
    paged.physical_to_logical.scatter_(1, table, logical)
    logical_mask = create_block_mask(noop_mask, case.batch, 1, 1, case.context, device=str(device),
                                     BLOCK_SIZE=(128, page_size))
    block_mask = paged.convert_logical_block_mask(logical_mask)
    score_mod = paged.get_score_mod(None)
    compiled = torch.compile(flex_attention, fullgraph=True)
    q = case.query.unsqueeze(2)

    def run():
        return compiled(q, k_pool, v_pool, block_mask=block_mask, score_mod=score_mod, scale=case.scale,
                        enable_gqa=case.kv_heads != NUM_HEADS).squeeze(2)

    return run, (k_pool, v_pool, paged, block_mask)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def bench_decode(timer, device, copy_gbps, configs, budget_s, reps, results, save):
    """Appends one entry per configuration to `results`, calling save() after each."""
    start = time.monotonic()
    for kv_heads in KV_HEADS:
        for batch, context in configs:
            entry = {"num_heads": NUM_HEADS, "kv_heads": kv_heads, "batch": batch, "context": context}
            results.append(entry)
            kv_bytes = batch * context * kv_heads * HEAD_SIZE * 2 * 2
            entry["kv_bytes"] = kv_bytes
            budget = 0.85 * free_bytes(device)
            if kv_bytes > budget:
                entry["skipped"] = f"KV ({kv_bytes / 1e9:.1f} GB) does not fit in device memory"
                continue
            if time.monotonic() - start > budget_s:
                entry["skipped"] = "time budget"
                continue
            try:
                case = DecodeCase(batch, context, kv_heads, device)
                want = case.paged()
                entry["paged"] = summary(timer(case.paged, reps), kv_bytes, copy_gbps)
            except Exception as e:  # noqa: BLE001 (a failing case is recorded; the run goes on)
                entry["paged"] = {"error": error_text(e)}
                case = want = None
                save()
                continue
            if 2.5 * kv_bytes > budget:  # the gather's intermediates too
                entry["sdpa"] = {"skipped": "a contiguous copy of the KV does not fit"}
            else:
                try:
                    run, keep = sdpa_candidate(case)
                    entry["sdpa"] = summary(timer(run, reps), kv_bytes, copy_gbps)
                    entry["sdpa"]["max_abs_diff_vs_paged"] = max_diff(run(), want)
                    del run, keep
                except Exception as e:  # noqa: BLE001 (a baseline that fails is recorded, not fatal)
                    entry["sdpa"] = {"error": error_text(e)}
            del case, want
            save()
    return results


# (kv_heads, batch, context): the fp8 GPU target's shapes, B >= 64 and context >= 4k.
FORMAT_CONFIGS = [(8, 64, 4096), (8, 256, 4096), (8, 64, 16384), (32, 64, 4096), (32, 128, 8192)]
FP8_TARGET = 1.7


def quantize_per_head(cache, dtype):
    """(fp8 cache, per-head fp32 scales): each KV head's absmax mapped to the format's max."""
    amax = cache.float().abs().amax(dim=(0, 2, 3)).clamp_min(1e-6)
    scale = amax / torch.finfo(dtype).max
    return (cache.float() / scale.view(1, -1, 1, 1)).to(dtype), scale


def quantize_per_token(cache, dtype, chunk=1024):
    """(per-token int8 / int4 cache, its scales), quantized ``chunk`` blocks at a time so the
    int4 rotation's fp32 temporaries stay small."""
    num_blocks, kv_heads, block_size, head_size = cache.shape
    rows = torch.empty((num_blocks, kv_heads, block_size, token_quantization.stored_head_size(dtype, head_size)),
                       dtype=dtype, device=cache.device)
    scales = torch.empty(token_quantization.scale_shape(dtype, num_blocks, kv_heads, block_size), device=cache.device)
    for b in range(0, num_blocks, chunk):
        rows[b:b + chunk], scales[b:b + chunk] = token_quantization.quantize(cache[b:b + chunk], dtype)
    return rows, scales


def nhd_view(cache):
    """The same values in an NHD tensor, as the HND-shaped view the ops take."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def bench_kv_formats(timer, device, copy_gbps, quick, reps, save, results):
    """fp8 and per-token int8 / int4 vs bf16 caches and NHD vs HND views on the same decode
    configurations."""
    configs = [(8, 4, 1024), (32, 2, 1024)] if quick else FORMAT_CONFIGS
    for kv_heads, batch, context in configs:
        entry = {"num_heads": NUM_HEADS, "kv_heads": kv_heads, "batch": batch, "context": context}
        results.append(entry)
        if 2.2 * batch * context * kv_heads * HEAD_SIZE * 2 * 2 > 0.85 * free_bytes(device):
            entry["skipped"] = "bf16, fp8 and NHD copies of the KV do not fit"
            continue
        try:
            case = DecodeCase(batch, context, kv_heads, device)
            k_bf16, v_bf16 = case.key_cache, case.value_cache
            want = case.paged()

            def run(name, key, value, scales=None, base=None):
                case.key_cache, case.value_cache = key, value
                call = (lambda: pa.attention(case.query, key, value, case.block_tables, case.seq_lens, case.scale,
                                             k_scale=scales[0], v_scale=scales[1])) if scales else case.paged
                per_token = token_quantization.is_per_token(key.dtype)
                nbytes = 2 * (key.numel() * key.element_size() + (scales[0].numel() * 4 if per_token else 0))
                seconds = timer(call, reps)
                result = summary(seconds, nbytes, copy_gbps)
                result["max_abs_diff_vs_bf16"] = max_diff(call(), want)
                if "bf16_hnd" in entry:
                    result["speedup_vs_bf16"] = entry["bf16_hnd"]["median_ms"] / result["median_ms"]
                if base is not None:
                    result["time_vs_hnd"] = result["median_ms"] / entry[base]["median_ms"]
                entry[name] = result
                save()

            run("bf16_hnd", k_bf16, v_bf16)
            for dtype, tag in ((torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2")):
                (k8, ks), (v8, vs) = quantize_per_head(k_bf16, dtype), quantize_per_head(v_bf16, dtype)
                run(f"{tag}_hnd", k8, v8, (ks, vs))
                if tag == "fp8_e4m3":
                    run(f"{tag}_nhd", nhd_view(k8), nhd_view(v8), (ks, vs), base=f"{tag}_hnd")
                del k8, v8
            run("bf16_nhd", nhd_view(k_bf16), nhd_view(v_bf16), base="bf16_hnd")
            for dtype, tag in ((torch.int8, "int8_token"), (torch.uint8, "int4_token")):
                (kq, ks), (vq, vs) = quantize_per_token(k_bf16, dtype), quantize_per_token(v_bf16, dtype)
                run(f"{tag}_hnd", kq, vq, (ks, vs))
                del kq, vq, ks, vs
            del case, want, k_bf16, v_bf16
        except Exception as e:  # noqa: BLE001 (a failing case is recorded; the run goes on)
            entry["error"] = error_text(e)
        save()
    return results


def fp8_target(results):
    """The fp8 GPU target over the measured rows: every fp8 HND row >= FP8_TARGET x bf16."""
    speedups = [e[f]["speedup_vs_bf16"] for e in results for f in ("fp8_e4m3_hnd", "fp8_e5m2_hnd")
                if "speedup_vs_bf16" in e.get(f, {}) and e["batch"] >= 64 and e["context"] >= 4096]
    return {"rule": f"fp8 decode >= {FP8_TARGET}x bf16 at batch >= 64, context >= 4k", "rows": len(speedups),
            "min_speedup": min(speedups) if speedups else None,
            "met": bool(speedups) and min(speedups) >= FP8_TARGET}


def bench_padded(timer, device, copy_gbps, quick, reps):
    """Decode with block tables padded to 128k keys against tables of the real width."""
    results = []
    kv_heads, context, width = 8, 4096, 128 * 1024 // BLOCK_SIZE
    batches = (1, 64)
    if quick:
        context, width, batches = 1024, 16 * 1024 // BLOCK_SIZE, (1, 4)
    for batch in batches:
        entry = {"num_heads": NUM_HEADS, "kv_heads": kv_heads, "batch": batch, "context": context,
                 "table_keys": width * BLOCK_SIZE}
        results.append(entry)
        try:
            case = DecodeCase(batch, context, kv_heads, device)
            kv_bytes = case.kv_bytes
            entry["exact_table"] = summary(timer(case.paged, reps), kv_bytes, copy_gbps)
            want = case.paged()
            padded = torch.zeros(batch, width, dtype=torch.int32, device=device)
            padded[:, :case.block_tables.shape[1]] = case.block_tables
            case.block_tables = padded
            entry["padded_table"] = summary(timer(case.paged, reps), kv_bytes, copy_gbps)
            entry["padded_table"]["max_abs_diff_vs_exact"] = max_diff(case.paged(), want)
            del case, want, padded
        except Exception as e:  # noqa: BLE001 (recorded, not fatal)
            entry["error"] = error_text(e)
    return results


def bench_flex(timer, device, copy_gbps, decode_results, order, budget_s, reps):
    """FlexAttention on the (batch, context) configurations of `order` while the budget lasts."""
    start = time.monotonic()
    for batch, context in order:
        for kv_heads in KV_HEADS:
            entry = next((e for e in decode_results if (e["kv_heads"], e["batch"], e["context"]) ==
                          (kv_heads, batch, context)), None)
            if entry is None or "paged" not in entry:
                continue
            if time.monotonic() - start > budget_s:
                entry["flex_paged"] = {"skipped": "time budget"}
                continue
            if 3 * entry["kv_bytes"] > 0.85 * free_bytes(device):  # paged, contiguous and flex copies
                entry["flex_paged"] = {"skipped": "its copy of the KV does not fit"}
                continue
            case = DecodeCase(batch, context, kv_heads, device)
            want = case.paged()
            errors = []
            for page_size in (BLOCK_SIZE, 128):
                try:
                    compile_start = time.monotonic()
                    run, keep = flex_candidate(case, page_size)
                    got = run()
                    compile_s = time.monotonic() - compile_start
                    result = summary(timer(run, reps), entry["kv_bytes"], copy_gbps)
                    result.update(page_size=page_size, setup_and_compile_s=compile_s,
                                  max_abs_diff_vs_paged=max_diff(got, want))
                    entry["flex_paged"] = result
                    del run, keep, got
                    break
                except Exception as e:  # noqa: BLE001 (recorded; the next page size is tried)
                    errors.append(f"page_size {page_size}: " + error_text(e))
            if "flex_paged" not in entry:
                entry["flex_paged"] = {"error": errors}
            del case, want


def bench_cache_ops(timer, device, copy_gbps, quick, reps):
    kv_heads, gen = 8, torch.Generator(device=device).manual_seed(1)
    block_bytes = kv_heads * BLOCK_SIZE * HEAD_SIZE * 2
    out = {}

    num_blocks, tokens = (64, 256) if quick else (8192, 16384)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE)
    key_cache, value_cache = (torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(2))
    key, value = (torch.randn(tokens, kv_heads, HEAD_SIZE, generator=gen, device=device, dtype=DTYPE)
                  for _ in range(2))
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:tokens]
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    out["write_kv"] = summary(timer(lambda: pa.write_kv(key, value, key_cache, value_cache, slots), reps),
                              moved, copy_gbps)
    out["write_kv"].update(tokens=tokens)
    # The same tokens quantized into an fp8 cache (bf16 read, one byte written per element).
    fp8 = torch.float8_e4m3fn
    key_fp8, value_fp8 = key_cache.to(fp8), value_cache.to(fp8)
    scales = torch.full((kv_heads,), 0.05, device=device)
    moved = 3 * key.numel() * key.element_size()  # K and V: 2 bytes read, 1 written per element
    out["write_kv_fp8_e4m3"] = summary(timer(lambda: pa.write_kv(key, value, key_fp8, value_fp8, slots,
                                                                 k_scale=scales, v_scale=scales), reps),
                                       moved, copy_gbps)
    out["write_kv_fp8_e4m3"].update(tokens=tokens)
    del key_cache, value_cache, key, value, slots, key_fp8, value_fp8

    layers, pairs, num_blocks = (2, 16, 64) if quick else (32, 1024, 4096)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE)
    keys = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(layers)]
    values = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(layers)]
    ids = torch.randperm(num_blocks, generator=gen, device=device)[:2 * pairs].view(pairs, 2).cpu()
    mapping = ids.to(device)
    moved = layers * 2 * pairs * block_bytes * 2
    out["copy_blocks"] = summary(timer(lambda: pa.copy_blocks(keys, values, mapping), reps), moved, copy_gbps)
    out["copy_blocks"].update(layers=layers, pairs=pairs, mapping="device")
    del keys, values

    blocks, pool = (16, 64) if quick else (2048, 8192)
    shape = (pool, kv_heads, BLOCK_SIZE, HEAD_SIZE)
    gpu_pool = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    other_gpu = torch.zeros_like(gpu_pool)
    host = torch.zeros(shape, dtype=DTYPE)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = blocks * block_bytes
    plain_host = host[:blocks]
    plain_dev = gpu_pool[:blocks]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain = timer(lambda: (plain_host.copy_(plain_dev, non_blocking=True), sync()), reps)
    out["pinned_copy_d2h_gbps"] = moved / plain / 1e9
    for order in ("random", "consecutive"):
        if order == "random":
            ids = torch.randperm(pool)[:2 * blocks].view(blocks, 2)
        else:
            ids = torch.stack([torch.arange(blocks), torch.arange(blocks) + blocks], 1)
        for name, src, dst, mapping in (("d2h", gpu_pool, host, ids), ("h2d", host, gpu_pool, ids.flip(1)),
                                        ("d2d", gpu_pool, other_gpu, ids)):
            seconds = timer(lambda: (pa.swap_blocks(src, dst, mapping), sync()), reps)
            result = {"median_ms": seconds * 1e3, "gbps": moved / seconds / 1e9, "blocks": blocks}
            if name == "d2d":  # device-only: read + write, against the device copy
                result["pct_of_copy"] = 100.0 * 2 * moved / seconds / 1e9 / copy_gbps
            else:
                result["pct_of_pinned_copy"] = 100.0 * result["gbps"] / out["pinned_copy_d2h_gbps"]
            out[f"swap_blocks_{name}_{order}"] = result
    return out


def print_table(report):
    print(f"device: {report['device']}, copy bandwidth {report['copy_gbps']:.0f} GB/s (read + write)")
    formats = ("bf16_hnd", "fp8_e4m3_hnd", "fp8_e5m2_hnd", "bf16_nhd", "fp8_e4m3_nhd", "int8_token_hnd",
               "int4_token_hnd")
    if report.get("kv_formats"):
        print(f"{'heads':>7} {'batch':>5} {'ctx':>6} | " + " | ".join(f"{f:>14}" for f in formats)
              + "   (ms; fp8, int8, int4: x bf16; nhd: x hnd)")
    for e in report.get("kv_formats", []):
        cells = []
        for f in formats:
            r = e.get(f, {})
            if "median_ms" not in r:
                cells.append(f"{'-':>14}")
                continue
            ratio = r.get("time_vs_hnd", r.get("speedup_vs_bf16"))
            cells.append(f"{r['median_ms']:>7.3f}" + (f" {ratio:>5.2f}x" if ratio else " " * 7))
        why = e.get("skipped") or e.get("error") or ""
        print(f"{NUM_HEADS}/{e['kv_heads']:<4} {e['batch']:>5} {e['context']:>6} | " + " | ".join(cells) + f" {why}")
    if "fp8_target" in report:
        print(f"fp8 target: {report['fp8_target']}")
    print(f"{'heads':>7} {'batch':>5} {'ctx':>6} {'KV GB':>6} | {'paged GB/s':>10} {'%copy':>6} | "
          f"{'sdpa GB/s':>9} | {'flex GB/s':>9}")
    for e in report.get("decode", []):
        heads = f"{e['num_heads']}/{e['kv_heads']}"
        if "skipped" in e or "gbps" not in e.get("paged", {}):
            why = e.get("skipped") or e.get("paged", {}).get("error")
            print(f"{heads:>7} {e['batch']:>5} {e['context']:>6} {e['kv_bytes'] / 1e9:>6.1f} | skipped: {why}")
            continue

        def gbps(key):
            c = e.get(key)
            return f"{c['gbps']:>9.0f}" if c and "gbps" in c else f"{'-':>9}"

        p = e["paged"]
        print(f"{heads:>7} {e['batch']:>5} {e['context']:>6} {e['kv_bytes'] / 1e9:>6.1f} | {p['gbps']:>10.0f} "
              f"{p['pct_of_copy']:>5.0f}% | {gbps('sdpa')} | {gbps('flex_paged')}")
    for e in report.get("decode_padded", []):
        if "padded_table" in e:
            print(f"padded table, batch {e['batch']}: {e['padded_table']['gbps']:.0f} GB/s vs "
                  f"{e['exact_table']['gbps']:.0f} GB/s with the exact table")
    for name, r in report.get("cache_ops", {}).items():
        if isinstance(r, dict) and "gbps" in r:
            extra = "".join(f", {k} {v:.0f}%" for k, v in r.items() if k.startswith("pct"))
            print(f"{name}: {r['gbps']:.1f} GB/s{extra}")


def bench_cascade(timer, device, quick, reps):
    """Decode of 8 (quick: 4) sequences sharing a 4096-token prompt (64 own tokens each),
    32/8 heads: the plain op against the cascade plan's three ops."""
    from paged_attention_ext.cascade import plan_cascade

    seqs, prefix, own, heads, kv_heads = (4, 1024, 64, 32, 8) if quick else (8, 4096, 64, 32, 8)
    prefix_blocks, own_blocks = prefix // BLOCK_SIZE, own // BLOCK_SIZE
    tables = [list(range(prefix_blocks)) + [prefix_blocks + i * own_blocks + j for j in range(own_blocks)]
              for i in range(seqs)]
    num_blocks = prefix_blocks + seqs * own_blocks
    g = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE)
    key = torch.randn(shape, generator=g, device=device).to(DTYPE)
    value = torch.randn(shape, generator=g, device=device).to(DTYPE)
    query = torch.randn(seqs, heads, HEAD_SIZE, generator=g, device=device).to(DTYPE)
    table = torch.tensor(tables, dtype=torch.int32, device=device)
    lens = torch.full((seqs,), prefix + own, dtype=torch.int32, device=device)
    plan = plan_cascade(tables, [prefix + own] * seqs, [1] * seqs, BLOCK_SIZE, device, 1)
    plain = lambda: pa.attention(query, key, value, table, lens, HEAD_SIZE ** -0.5)  # noqa: E731
    split = lambda: plan.run(query, key, value, HEAD_SIZE ** -0.5)  # noqa: E731
    plain_s, split_s = timer(plain, reps), timer(split, reps)
    return {"sequences": seqs, "prefix": prefix, "own": own, "heads": f"{heads}/{kv_heads}",
            "plain_us": plain_s * 1e6, "cascade_us": split_s * 1e6, "speedup": plain_s / split_s,
            "max_abs_diff": max_diff(split(), plain())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cuda.json"))
    parser.add_argument("--quick", action="store_true", help="few small configurations")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds for the decode sweep; FlexAttention gets another half of it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", choices=["kv_formats"], help="run this phase alone")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    reps = 5 if args.quick else 20
    timer = Timer(device)
    copy_gbps = copy_bandwidth(timer, device, (64 << 20) if args.quick else (2 << 30))
    configs = [(1, 1024), (8, 1024)] if args.quick else [(b, c) for b in BATCHES for c in CONTEXTS]
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(DTYPE).replace("torch.", ""),
        "head_size": HEAD_SIZE,
        "block_size": BLOCK_SIZE,
        "copy_gbps": copy_gbps,
        "complete": False,
        "decode": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    # The fp8 / layout rows first: the fp8 target, and the phase a short run must not lose.
    report["kv_formats"] = []
    bench_kv_formats(timer, device, copy_gbps, args.quick, reps, save, report["kv_formats"])
    report["fp8_target"] = fp8_target(report["kv_formats"])
    save()
    if args.only == "kv_formats":
        report["complete"] = True
        save()
        print_table(report)
        print(f"wrote {out}")
        return
    try:  # cheap: before the long sweep
        report["cascade"] = bench_cascade(timer, device, args.quick, reps)
    except Exception as e:  # noqa: BLE001 (recorded, not fatal)
        report["cascade"] = {"error": error_text(e)}
    save()
    bench_decode(timer, device, copy_gbps, configs, args.budget_s, reps, report["decode"], save)
    try:
        report["decode_padded"] = bench_padded(timer, device, copy_gbps, args.quick, reps)
    except Exception as e:  # noqa: BLE001 (recorded, not fatal)
        report["decode_padded"] = {"error": error_text(e)}
    save()
    try:
        report["cache_ops"] = bench_cache_ops(timer, device, copy_gbps, args.quick, reps)
    except Exception as e:  # noqa: BLE001 (recorded, not fatal)
        report["cache_ops"] = {"error": error_text(e)}
    save()
    # FlexAttention last: it compiles per shape, the slowest and least essential phase.
    try:
        bench_flex(timer, device, copy_gbps, report["decode"], configs if args.quick else FLEX_ORDER,
                   args.budget_s / 2, reps)
    except Exception as e:  # noqa: BLE001 (recorded, not fatal)
        report["flex_error"] = error_text(e)
    report["complete"] = True
    save()
    print_table(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
