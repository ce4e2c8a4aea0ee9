"""Host-side tests of the CUDA attention planner (csrc/cuda/attention_plan.*).

The planner and the key schedule the kernel walks are plain C++, so they are tested
here without a GPU: a small driver is compiled with the host C++ compiler (g++ or
$CXX) against csrc/cuda/attention_plan.cpp, fed shapes on stdin, and prints each plan.
The CUDA kernels themselves are tested in test_cuda.py (on a GPU only).
"""

import functools
import json
import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SRC = os.path.join(ROOT, "csrc", "cuda")
INT32_MAX = 2 ** 31 - 1

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include <string>
#include <set>
#include "attention_plan.h"
using namespace paged::cuda;

// Lines: "plan T S H KVH BS W WINDOW MULTI SMS C1 C2 C4 C8 HSV" -> one JSON plan;
// "schedule BEGIN END SPLITS" -> the keys every split and warp visits, as JSON.
int main() {
  char kind[16];
  while (std::scanf("%15s", kind) == 1) {
    if (std::strcmp(kind, "plan") == 0) {
      AttentionPlanInput in{};
      int multi = 0;
      std::scanf("%lld %lld %lld %lld %lld %lld %lld %d %d %d %d %d %d %lld",
                 (long long*)&in.num_tokens, (long long*)&in.num_seqs, (long long*)&in.num_heads,
                 (long long*)&in.num_kv_heads, (long long*)&in.block_size,
                 (long long*)&in.max_blocks_per_seq, (long long*)&in.sliding_window, &multi,
                 &in.multiprocessors, &in.ctas_per_sm[0], &in.ctas_per_sm[1], &in.ctas_per_sm[2],
                 &in.ctas_per_sm[3], (long long*)&in.head_size_v);
      in.multi_token = multi != 0;
      const AttentionPlan p = plan_attention(in);
      std::printf("{\"rows_per_tile\": %d, \"heads_per_cta\": %d, \"head_chunks\": %d, "
                  "\"query_bucket\": %d, \"queries\": %d, \"num_tiles\": %lld, "
                  "\"num_partitions\": %d, \"partition_size\": %d, \"max_keys\": %lld}\n",
                  p.rows_per_tile, p.heads_per_cta, p.head_chunks, p.query_bucket,
                  kQueryBuckets[p.query_bucket], (long long)p.num_tiles, p.num_partitions,
                  p.partition_size, (long long)p.max_keys);
    } else {
      long long begin, end, splits;
      std::scanf("%lld %lld %lld", &begin, &end, &splits);
      // The kernel's loop (attention_kernels.cuh), lanes collapsed to a step's 32 keys.
      std::string out = "[";
      for (long long z = 0; z < splits; ++z) {
        const long long split_begin = begin + z * kChunkKeys;
        if (splits > 1 && split_begin >= end) continue;
        const KeySchedule s{int(end), kChunkKeys, (splits - 1) * kChunkKeys};
        for (int warp = 0; warp < 4; ++warp) {
          int t0 = int(split_begin) + warp * 32, offset = warp * 32, steps = 0;
          while (t0 < end) {
            for (int k = 0; k < 32 && t0 + k < end; ++k) {
              out += std::to_string(z) + "," + std::to_string(t0 + k) + ",";
            }
            t0 = s.next(t0, &offset);
            if (++steps > 100000000) return 3;
          }
        }
      }
      if (out.size() > 1) out.pop_back();
      std::printf("%s]\n", out.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
"""


@functools.lru_cache(maxsize=None)
def driver() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    tmp = tempfile.mkdtemp(prefix="paged_plan_")
    src, exe = os.path.join(tmp, "driver.cpp"), os.path.join(tmp, "driver")
    with open(src, "w") as f:
        f.write(DRIVER)
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", CUDA_SRC, src,
                    os.path.join(CUDA_SRC, "attention_plan.cpp"), "-o", exe], check=True)
    return exe


def run(lines):
    result = subprocess.run([driver()], input="\n".join(lines) + "\n", capture_output=True, text=True,
                            check=True, timeout=120)
    return [json.loads(line) for line in result.stdout.splitlines()]


def plan(num_seqs, heads, kv_heads, width, *, block_size=16, num_tokens=None, window=-1, multi=False,
         sms=132, ctas_per_sm=(3, 3, 3, 3), head_size_v=128):
    num_tokens = num_seqs if num_tokens is None else num_tokens
    line = (f"plan {num_tokens} {num_seqs} {heads} {kv_heads} {block_size} {width} {window} {int(multi)} {sms} "
            + " ".join(map(str, ctas_per_sm)) + f" {head_size_v}")
    return run([line])[0]


def active_ctas(p, real_len, num_seqs, kv_heads):
    """CTAs that find keys when every sequence is real_len long (decode)."""
    chunks = -(-real_len // p["partition_size"])
    return num_seqs * kv_heads * p["head_chunks"] * min(p["num_partitions"], chunks)


# ---- int64 arithmetic for user-controlled sizes --------------------------------------

@pytest.mark.parametrize("window", [INT32_MAX, INT32_MAX - 3, 2 ** 31 - 8])
def test_window_near_int32_max_plans_like_no_window(window):
    # The planner used to compute window + rows_per_tile - 1 in int: a window near
    # INT32_MAX wrapped negative, giving partitions of 1 key and wrong output.
    for multi in (False, True):
        got = plan(4, 32, 8, 2048, num_tokens=40, window=window, multi=multi)
        want = plan(4, 32, 8, 2048, num_tokens=40, window=-1, multi=multi)
        assert got == want, (window, multi)
        assert got["partition_size"] == 512 and got["max_keys"] == 2048 * 16


def test_window_bounds_the_key_range():
    p = plan(1, 32, 8, 8192, window=4096, multi=True, num_tokens=8)
    assert p["max_keys"] == 4096 + p["rows_per_tile"] - 1


def test_largest_table_fits_int32_positions():
    # 2^31 - 2^11 keys per sequence (the CUDA host check's bound) plans without overflow.
    p = plan(1, 8, 8, (2 ** 31 - 2 ** 11) // 16)
    assert p["max_keys"] == 2 ** 31 - 2 ** 11 and 1 <= p["num_partitions"] <= 512


# ---- fixed-size chunks, grid from the table width ------------------------------------

def test_padded_table_single_sequence_spreads_real_keys():
    # B=1, a 128k-wide table (CUDA-graph padding), 4k real context, 32/8 heads. The old
    # planner made 43 partitions of 3072 keys: 2 did work, 16 CTAs on 132 SMs.
    p = plan(1, 32, 8, 128 * 1024 // 16)
    assert p["partition_size"] == 512
    assert active_ctas(p, 4096, 1, 8) >= 64
    # and the whole grid (empty splits exit at once) stays within about a wave
    assert p["num_partitions"] * 8 <= 2 * 132 * 3


def test_batch_64_is_split_too():
    # B=64 with 32/8 heads: 512 CTAs over 396 slots is 1.3 waves; the old planner did
    # not split at all.
    p = plan(64, 32, 8, 32 * 1024 // 16)
    assert p["num_partitions"] > 1
    ctas = 64 * 8 * p["num_partitions"]
    waves = ctas / (132 * 3)
    assert waves / -(-ctas // (132 * 3)) >= 0.8


def test_short_table_is_not_split():
    assert plan(1, 32, 8, 512 // 16)["num_partitions"] == 1
    assert plan(1, 32, 8, 8)["num_partitions"] == 1  # 128 keys


def test_large_batch_prefill_is_not_split():
    p = plan(16, 32, 8, 4096 // 16, num_tokens=16 * 1024, multi=True)
    assert p["num_partitions"] == 1


def test_split_count_bounded():
    # One CTA on a huge GPU: as many splits as allowed, never more than 512.
    p = plan(1, 1, 1, 2 ** 26, block_size=16, sms=1000)
    assert 0.85 * 512 <= p["num_partitions"] <= 512


@pytest.mark.parametrize("begin,end,splits", [
    (0, 1, 1), (0, 128, 1), (0, 5000, 1), (7, 4100, 3), (0, 4096, 8), (100, 100 + 512 * 9 + 33, 4),
    (0, 511, 50), (3, 3 + 512 * 50, 50), (0, 1000, 2), (5, 6, 7),
])
def test_key_schedule_visits_every_key_once(begin, end, splits):
    visited = run([f"schedule {begin} {end} {splits}"])[0]
    pairs = list(zip(visited[::2], visited[1::2]))
    keys = [k for _, k in pairs]
    assert sorted(keys) == list(range(begin, end)), "every key exactly once"
    # split z holds exactly the chunks z, z + splits, ...
    for z, k in pairs:
        assert ((k - begin) // 512) % splits == z


# ---- occupancy from the runtime --------------------------------------------------------

def test_occupancy_drives_the_split():
    # sm_86/89 with head size 256 fit 2 CTAs per SM, not 3: the planner sizes the
    # waves with the number it is given.
    for ctas_per_sm in (1, 2, 3, 6):
        p = plan(2, 32, 8, 4096, sms=84, ctas_per_sm=(ctas_per_sm,) * 4)
        slots = 84 * ctas_per_sm
        ctas = 2 * 8 * p["num_partitions"]
        waves = ctas / slots
        assert waves / -(-ctas // slots) >= 0.85 * 0.99, ctas_per_sm
    assert plan(2, 32, 8, 4096, sms=84, ctas_per_sm=(2,) * 4) != plan(2, 32, 8, 4096, sms=84, ctas_per_sm=(6,) * 4)


def test_occupancy_of_the_chosen_instance_is_used():
    # MHA decode runs the 1-query instance: only its occupancy entry matters.
    a = plan(4, 32, 32, 4096, ctas_per_sm=(2, 9, 9, 9))
    b = plan(4, 32, 32, 4096, ctas_per_sm=(2, 1, 1, 1))
    assert a == b and a["query_bucket"] == 0


# ---- instances by queries per CTA ------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,multi,queries", [
    (32, 32, False, 1), (32, 16, False, 2), (32, 8, False, 4), (24, 8, False, 4), (32, 4, False, 8),
    (64, 4, False, 8), (40, 8, False, 8), (32, 32, True, 8), (24, 8, True, 8), (32, 8, True, 8),
])
def test_query_bucket(heads, kv_heads, multi, queries):
    p = plan(4, heads, kv_heads, 64, multi=multi, num_tokens=20 if multi else 4)
    assert p["queries"] == queries
    assert p["rows_per_tile"] * p["heads_per_cta"] <= queries


def test_tiles_and_head_chunks():
    p = plan(3, 64, 2, 64, multi=True, num_tokens=10)
    assert (p["heads_per_cta"], p["head_chunks"], p["rows_per_tile"]) == (8, 4, 1)
    assert p["num_tiles"] == 10 + 3
    p = plan(3, 16, 4, 64, multi=True, num_tokens=10)
    assert (p["heads_per_cta"], p["rows_per_tile"], p["num_tiles"]) == (4, 2, 5 + 3)


@pytest.mark.parametrize("head_size_v, most", [(256, 8), (264, 4), (512, 4)])
def test_value_rows_past_256_take_at_most_four_queries_per_cta(head_size_v, most):
    """The instances of value heads past 256 hold 4 queries (their merge buffer would pass
    48 KB of shared memory at 8): GQA groups, MLA's 16 heads on one latent head and
    multi-token tiles are cut to fit."""
    for heads, kv_heads, multi in ((8, 1, False), (16, 1, False), (4, 2, True), (2, 2, True)):
        p = plan(4, heads, kv_heads, 64, num_tokens=40 if multi else None, multi=multi,
                 head_size_v=head_size_v)
        assert p["queries"] <= most
        assert p["rows_per_tile"] * p["heads_per_cta"] <= most
        assert p["heads_per_cta"] * p["head_chunks"] >= heads // kv_heads
