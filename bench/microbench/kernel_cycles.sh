#!/usr/bin/env bash
# Build and run kernel_cycles.cpp against a source tree's kernel (see that file).
#   [ISA=avx2] bash bench/microbench/kernel_cycles.sh [SOURCE_DIR] [-DFLAG ...]
# ISA: the kernel to time (generic, avx2, avx512, avx512_bf16; default avx512_bf16).
# RESIDENT: bytes of K (and of V) the block tables cycle over (default 512 KiB; their sum
# must fit the core's L2 for an arithmetic-only reading).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="${1:-$here/../..}"
[[ $# -gt 0 ]] && shift
isa="${ISA:-avx512_bf16}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# setup.py's C++ flags (plus torch's -O3 -fwrapv -fPIC), so GCC makes the same inlining choices.
g++ -std=c++20 -O3 -fwrapv -fPIC -fopenmp -fvisibility=hidden -Wno-psabi -DNDEBUG "$@" \
    -c "$src/csrc/cpu/isa_$isa.cpp" -o "$out/kernel.o"
g++ -std=c++20 -O2 -mf16c -DKERNEL_ISA="$isa" -I "$src/csrc/cpu" -c "$here/kernel_cycles.cpp" -o "$out/main.o"
g++ "$out/kernel.o" "$out/main.o" -fopenmp -o "$out/kernel_cycles"
"$out/kernel_cycles" ${RESIDENT:-}
