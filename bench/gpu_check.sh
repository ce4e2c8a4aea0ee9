#!/usr/bin/env bash
# Verification of the CUDA kernels on a GPU machine (torch with CUDA installed, no
# internet needed): builds the extension in place for the local GPU, runs the CUDA
# tests, the benchmarks and, where compute-sanitizer exists and time is left, a memory
# check of the metadata-clamping tests. Logs, bench_cuda.json and summary.json go to
# OUT_DIR. Each step is bounded so the whole run ends within 8 minutes.
#
#   bench/gpu_check.sh OUT_DIR        (PYTHON=... to pick the interpreter)
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
DEADLINE=465  # seconds: 8 minutes less a margin
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi

RESULTS=()
FAILED=0
# step NAME LIMIT_S COMMAND...: runs COMMAND into OUT/NAME.log within LIMIT_S and
# what is left of the deadline.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local left=$((DEADLINE - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "== $name: skipped, the deadline is near"
    RESULTS+=("$name:skipped:0")
    return 0
  fi
  echo "== $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $((SECONDS - t0))s; the log ends:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   | /'
  RESULTS+=("$name:$rc:$((SECONDS - t0))")
  ((rc == 0)) || FAILED=1
  return $rc
}

summary() {
  "$PY" - "$OUT" "$ARCH" "${RESULTS[@]}" <<'EOF'
import json, sys
out, arch, *steps = sys.argv[1:]
entries = []
for s in steps:
    name, rc, seconds = s.split(":")
    entries.append({"step": name, "exit": None if rc == "skipped" else int(rc), "seconds": int(seconds)})
json.dump({"arch": arch, "steps": entries}, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(entries))
EOF
}

{
  nvidia-smi || true
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  command -v nvcc && nvcc --version
} >"$OUT/env.log" 2>&1
ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>>"$OUT/env.log") || {
  echo "torch sees no CUDA device; see $OUT/env.log"
  exit 1
}
echo "GPU compute capability $ARCH; logs in $OUT"

if ! step build 300 env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace; then
  summary
  exit 1
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  step tests 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/tests.xml"
else  # the test module is its own runner where pytest is missing
  step tests 200 "$PY" tests/test_cuda.py
fi

step bench 270 "$PY" bench/bench_cuda.py --out "$OUT/bench_cuda.json" --budget-s 110

SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
if [ -x "$SANITIZER" ]; then
  step memcheck 150 "$SANITIZER" --tool memcheck --error-exitcode 9 "$PY" tests/test_cuda.py -k out_of_range
else
  echo "== memcheck: skipped, no compute-sanitizer"
fi

summary
echo "total $((SECONDS))s"
exit $FAILED
