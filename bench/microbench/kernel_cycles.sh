#!/usr/bin/env bash
# Build and run kernel_cycles.cpp against a source tree's kernel (see that file).
#   [ISA=avx2] [BASELINE=DIR] [ONLY="bf16 8"] bash bench/microbench/kernel_cycles.sh [SOURCE_DIR] [-DFLAG ...]
# ISA: the kernel to time (generic, avx2, avx512, avx512_vbmi, avx512_bf16, amx, amx_emulated;
# default avx512_bf16; amx items its tiles do not take run avx512_vbmi's kernel, linked
# beside it; amx_emulated is amx on the software model of its tiles: its cycles are the
# model's, not the hardware's).
# BASELINE: a second source tree (e.g. a `git worktree` of the commit before a change),
# timed in the same process in alternating rounds; the -D flags apply to SOURCE_DIR only.
# RESIDENT: bytes of K (and of V) the block tables cycle over (default 128 KiB; their sum
# must fit the core's L2 for an arithmetic-only reading); 268435456 (256 MiB) and more:
# every call reads fresh blocks in a random order, from DRAM.
# ROUNDS: alternating rounds of a BASELINE comparison (default 15).
# ONLY: one cache dtype and optionally one KV head count (e.g. "bf16 8"), for a profiler.
# CONTEXT: the item's keys (default 2048, a multiple of 32): short items show the per-item
# work (query tiles, set-up, the output) beside the per-step.
# MODIFIER: alibi, window or soft-cap: decode with ALiBi slopes, a sliding window of 1000
# keys or a soft cap of 50 (both trees).
# KEEP: a directory to keep the binary and libraries in (perf record -e cpu-clock on it:
# no hardware PMU in this guest).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "${1:-$here/../..}" && pwd)"
[[ $# -gt 0 ]] && shift
isa="${ISA:-avx512_bf16}"
out="${KEEP:-$(mktemp -d)}"
mkdir -p "$out"
[[ -n "${KEEP:-}" ]] || trap 'rm -rf "$out"' EXIT
# A tree's kernel as a shared library, with setup.py's C++ flags (plus torch's -O3 -fwrapv
# -fPIC), so GCC makes the same inlining choices.
build_kernel() {  # tree, library, extra flags...
  local tree="$1" lib="$2"
  shift 2
  local isas=("$isa") amx=0 tiles=0
  [[ "$isa" == amx || "$isa" == amx_emulated ]] && isas+=(avx512_vbmi) amx=1
  [[ "$isa" == amx ]] && tiles=1
  local objects=()
  for kernel_isa in "${isas[@]}"; do
    g++ -std=c++20 -O3 -fwrapv -fPIC -fopenmp -fvisibility=hidden -Wno-psabi -DNDEBUG "$@" \
        -c "$tree/csrc/cpu/isa_$kernel_isa.cpp" -o "$lib.$kernel_isa.o"
    objects+=("$lib.$kernel_isa.o")
  done
  g++ -std=c++20 -O2 -fPIC -fvisibility=hidden -DKERNEL_ISA="$isa" -DKERNEL_AMX=$amx -DKERNEL_AMX_TILES=$tiles -I "$tree/csrc/cpu" \
      -c "$here/kernel_entry.cpp" -o "$lib.entry.o"
  g++ -shared -fopenmp "${objects[@]}" "$lib.entry.o" -o "$lib"
}
build_kernel "$src" "$out/kernel.so" "$@"
baseline_lib=-
if [[ -n "${BASELINE:-}" ]]; then
  baseline_lib="$out/baseline.so"
  build_kernel "$(cd "$BASELINE" && pwd)" "$baseline_lib"
fi
g++ -std=c++20 -O2 -mf16c -DKERNEL_ISA="$isa" -DKERNEL_CONTEXT="${CONTEXT:-2048}" -I "$src/csrc/cpu" "$here/kernel_cycles.cpp" \
    -ldl -o "$out/kernel_cycles"
# shellcheck disable=SC2086  # ONLY is two words
"$out/kernel_cycles" "$out/kernel.so" "$baseline_lib" "${RESIDENT:-131072}" ${ONLY:-}
