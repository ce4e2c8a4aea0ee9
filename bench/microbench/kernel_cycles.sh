#!/usr/bin/env bash
# Build and run kernel_cycles.cpp against a source tree's kernel (see that file).
#   bash bench/microbench/kernel_cycles.sh [SOURCE_DIR] [-DFLAG ...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="${1:-$here/../..}"
[[ $# -gt 0 ]] && shift
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# setup.py's C++ flags (plus torch's -O3 -fwrapv -fPIC), so GCC makes the same inlining choices.
g++ -std=c++20 -O3 -fwrapv -fPIC -fopenmp -fvisibility=hidden -Wno-psabi -DNDEBUG "$@" \
    -c "$src/csrc/cpu/isa_avx512_bf16.cpp" -o "$out/kernel.o"
g++ -std=c++20 -O2 -mf16c -I "$src/csrc/cpu" -c "$here/kernel_cycles.cpp" -o "$out/main.o"
g++ "$out/kernel.o" "$out/main.o" -fopenmp -o "$out/kernel_cycles"
"$out/kernel_cycles"
