#!/usr/bin/env bash
# Verification of the CUDA kernels on a GPU machine (torch with CUDA installed, no
# internet needed): builds the extension in place for the local GPU, runs the CUDA
# tests, compute-sanitizer's memcheck (caching allocator off, so an out-of-bounds
# access inside a cached segment is seen) on a small scenario of every kernel path, the
# benchmark (fp8 vs bf16 and NHD vs HND decode first, then the rest while its budget
# lasts), the engine's compiled-decode benchmark when bench/bench_compiled_decode.py
# exists, then racecheck and synccheck. Logs, bench_cuda.json and summary.json go to
# OUT_DIR. Each step is bounded, and a step that fails is reported while the others
# still run; the whole run ends within 9 minutes (later steps are skipped, not
# started, when the deadline is near).
#
# A sanitizer that cannot run here (refuses the device, missing tool) or runs out of
# time is reported as "unavailable" or "timeout" in summary.json, not as a failure;
# the check fails (exit 1) only on a failed build, failed tests, a sanitizer that
# reports errors, or a failed benchmark.
#
#   bench/gpu_check.sh OUT_DIR        (PYTHON=... to pick the interpreter)
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
DEADLINE=530  # seconds: 9 minutes less a margin
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi

RESULTS=()
FAILED=0
# step NAME LIMIT_S COMMAND...: runs COMMAND into OUT/NAME.log within LIMIT_S and
# what is left of the deadline. Status: pass, fail, timeout or skipped.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc status
  shift 2
  local left=$((DEADLINE - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "== $name: skipped, the deadline is near"
    RESULTS+=("$name:skipped:-:0")
    return 0
  fi
  echo "== $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=pass ;;
    124 | 137) status=timeout ;;
    *) status=fail ;;
  esac
  echo "   $status (exit $rc) after $((SECONDS - t0))s; the log ends:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   | /'
  RESULTS+=("$name:$status:$rc:$((SECONDS - t0))")
  [ "$status" = pass ] || FAILED=1
  [ "$status" = pass ]
}

# sanitize NAME LIMIT_S TOOL [ENV=VALUE...]: compute-sanitizer's TOOL on the small
# scenario of tests/test_cuda.py (--scenario). Errors found (exit 9, or a nonzero
# ERROR SUMMARY) fail the check; a tool that cannot run (no ERROR SUMMARY in its
# log: device refused, tool error) is "unavailable" and a run past its time
# "timeout", both reported in summary.json but not failures.
REFUSED='not supported|internal sanitizer error|unable to (initialize|attach|load|find)|cannot (attach|find|load)|no attachable process|insufficient permissions|CUDA_ERROR_NOT_SUPPORTED'
sanitize() {
  local name=$1 limit=$2 tool=$3 t0=$SECONDS rc status
  shift 3
  local left=$((DEADLINE - SECONDS))
  ((limit > left)) && limit=$left
  if [ ! -x "$SANITIZER" ]; then
    echo "== $name: unavailable, no compute-sanitizer"
    RESULTS+=("$name:unavailable:-:0")
    return 0
  fi
  if ((limit < 20)); then
    echo "== $name: skipped, the deadline is near"
    RESULTS+=("$name:skipped:-:0")
    return 0
  fi
  echo "== $name (compute-sanitizer --tool $tool, at most ${limit}s)"
  timeout --kill-after=10 "$limit" env "$@" "$SANITIZER" --tool "$tool" --error-exitcode 9 \
    "$PY" tests/test_cuda.py --scenario >"$OUT/$name.log" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then
    status=timeout
  elif ((rc == 9)) || grep -Eq 'ERROR SUMMARY: [1-9]' "$OUT/$name.log"; then
    status=fail
  elif ((rc == 0)) && grep -q 'sanitizer scenario done' "$OUT/$name.log"; then
    status=pass
  elif ! grep -q 'ERROR SUMMARY' "$OUT/$name.log" || grep -Eiq "$REFUSED" "$OUT/$name.log"; then
    status=unavailable
  else
    status=fail  # the scenario itself failed under the tool
  fi
  echo "   $status (exit $rc) after $((SECONDS - t0))s; the log ends:"
  tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
  RESULTS+=("$name:$status:$rc:$((SECONDS - t0))")
  [ "$status" = fail ] && FAILED=1
  return 0
}

summary() {
  "$PY" - "$OUT" "$ARCH" "${RESULTS[@]}" <<'EOF'
import json, sys
out, arch, *steps = sys.argv[1:]
entries = []
for s in steps:
    name, status, rc, seconds = s.split(":")
    entries.append({"step": name, "status": status, "exit": None if rc == "-" else int(rc),
                    "seconds": int(seconds)})
failed = [e["step"] for e in entries
          if e["status"] in ("fail", "timeout") and e["step"] in ("build", "tests_kv", "tests", "bench",
                                                                   "compiled_decode")]
failed += [e["step"] for e in entries if e["status"] == "fail" and e["step"] not in failed]
json.dump({"arch": arch, "ok": not failed, "failed": failed, "steps": entries},
          open(f"{out}/summary.json", "w"), indent=2)
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

if ! step build 240 env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace; then
  summary
  exit 1
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  # The fp8 and layout tests first, so a slow run still reaches them.
  KV_TESTS="fp8 or strided or kv_format or token_format or per_token"
  step tests_kv 120 "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests/test_cuda.py -k "$KV_TESTS" \
    --junitxml="$OUT/tests_kv.xml"
  step tests 170 "$PY" -m pytest -q -p no:cacheprovider --durations=15 tests/test_cuda.py tests/test_cuda_plan.py \
    -k "not ($KV_TESTS)" --junitxml="$OUT/tests.xml"
else  # the test module is its own runner where pytest is missing
  step tests 190 "$PY" tests/test_cuda.py
fi

SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
# memcheck without the caching allocator: every tensor is its own allocation, so an
# access past a tensor's end falls outside any allocation and is caught.
sanitize memcheck 70 memcheck PYTORCH_NO_CUDA_MEMORY_CACHING=1

# The fp8 / layout rows come first inside the benchmark (the fp8 target's).
step bench 150 "$PY" bench/bench_cuda.py --out "$OUT/bench_cuda.json" --budget-s 50

# The engine's decode with CUDA graphs against eager (helper script, when present).
if [ -f bench/bench_compiled_decode.py ]; then
  COMPILED_ARGS=(--device cuda)
  if timeout 30 "$PY" bench/bench_compiled_decode.py --help 2>/dev/null | grep -q -- '--out'; then
    COMPILED_ARGS+=(--out "$OUT/compiled_decode.json")
  fi
  step compiled_decode 90 "$PY" bench/bench_compiled_decode.py "${COMPILED_ARGS[@]}"
else
  echo "== compiled_decode: skipped, no bench/bench_compiled_decode.py"
  RESULTS+=("compiled_decode:skipped:-:0")
fi

sanitize racecheck 50 racecheck
sanitize synccheck 40 synccheck

summary
echo "total $((SECONDS))s"
exit $FAILED
