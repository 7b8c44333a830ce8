#!/usr/bin/env bash
# shellcheck disable=SC2317  # step functions run through an exported `bash -c`
# The one script to run on an H100/H200 machine (no network needed): environment report, build,
# tests (GPU tests must not skip), compute-sanitizer memcheck and racecheck on the small GPU
# tests, and the benchmark. Every step's log goes to $MACHMOE_OUT_DIR:
#   $MACHMOE_OUT_DIR/build.log      environment (nvidia-smi, nvcc, python, torch) + the build
#   $MACHMOE_OUT_DIR/tests.log      scripts/test.sh (ctest + pytest) with MACHMOE_REQUIRE_GPU=1
#   $MACHMOE_OUT_DIR/sanitizer.log  compute-sanitizer memcheck on `pytest -m gpu -k small`, racecheck on the small GEMM cases
#   $MACHMOE_OUT_DIR/bench.log      python -m machmoe.bench (+ $MACHMOE_OUT_DIR/bench.md, bench.json, bench.png)
#   $MACHMOE_OUT_DIR/summary.txt    each step's status and time, and the benchmark's table
# A failing step does not stop the next one; the exit status is non-zero if any step failed.
# The whole run is held under GPU_CHECK_BUDGET_S seconds (default 560, to fit a 10-minute
# slot): each step gets a timeout from what is left, keeping time in reserve for the benchmark.
#
# Usage: MACHMOE_OUT_DIR=/some/dir scripts/gpu_check.sh [extra arguments for python -m machmoe.bench]
#   GPU_CHECK_SKIP="tests sanitizer"  skips steps by name (build, tests, sanitizer, bench)
set -uo pipefail

# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_check_out
export MACHMOE_LIBRARY_DIR="$root/build/lib"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export PY=$MACHMOE_PYTHON

budget=${GPU_CHECK_BUDGET_S:-560}
t_start=$SECONDS
skip=" ${GPU_CHECK_SKIP:-} "
declare -a step_names step_status step_secs step_logs
failed=0

left() { echo $(( budget - (SECONDS - t_start) )); }

# timeout_for MAX RESERVE: at most MAX seconds, leaving RESERVE seconds for the steps after.
timeout_for() {
  local t=$(( $(left) - $2 ))
  (( t > $1 )) && t=$1
  (( t < 10 )) && t=10
  echo "$t"
}

# record NAME STATUS SECONDS LOG
record() {
  step_names+=("$1"); step_status+=("$2"); step_secs+=("$3"); step_logs+=("$4")
  case "$2" in ok|skipped*) ;; *) failed=1 ;; esac
}

# run_step NAME LOG TIMEOUT CMD...: runs CMD with a timeout, tees it (appending) into LOG.
run_step() {
  local name=$1 log=$2 limit=$3; shift 3
  if [[ "$skip" == *" $name "* ]]; then
    record "$name" "skipped (GPU_CHECK_SKIP)" 0 "-"; return 0
  fi
  echo "===== $name (timeout ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS rc
  # bash -c so that CMD may be one of the exported shell functions below; timeout signals the
  # whole process group (ninja, python) when the limit is hit.
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local dt=$(( SECONDS - t0 ))
  local status=ok
  if (( rc == 124 || rc == 137 )); then status="TIMEOUT after ${limit}s"
  elif (( rc != 0 )); then status="FAILED (exit $rc)"; fi
  echo "===== $name: $status in ${dt}s" | tee -a "$log"
  record "$name" "$status" "$dt" "$(basename "$log")"
}

# ---------------------------------------------------------------- environment
env_report() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')   host: $(hostname)   cores: $(nproc)"
  echo "repo: $PWD  commit: ${MACHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi || echo "nvidia-smi failed"
  nvcc --version || echo "nvcc not found"
  command -v compute-sanitizer || echo "compute-sanitizer not on PATH"
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1))
EOF
}
export -f env_report
run_step env "$MACHMOE_OUT_DIR/build.log" 60 env_report

# ---------------------------------------------------------------- build
run_step build "$MACHMOE_OUT_DIR/build.log" "$(timeout_for 240 300)" scripts/build.sh

# ---------------------------------------------------------------- tests
run_tests() {
  MACHMOE_REQUIRE_GPU=1 scripts/test.sh --durations=15  # the slowest tests, to keep this step under its limit
}
export -f run_tests
run_step tests "$MACHMOE_OUT_DIR/tests.log" "$(timeout_for 330 150)" run_tests

# ---------------------------------------------------------------- compute-sanitizer
# Memcheck over the small GPU tests. PyTorch's caching allocator would hide out-of-bounds accesses
# inside its pooled blocks, so it is turned off (each tensor gets its own cudaMalloc). API-call
# errors are not reported because PyTorch probes the driver with calls that fail on purpose.
sanitize() {
  local cs
  cs=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [[ -z "$cs" && -x "$c" ]] && cs=$c
  done
  if [[ -z "$cs" ]]; then
    echo "compute-sanitizer not found (PATH, /usr/local/cuda): cannot run memcheck"; return 1
  fi
  local collect rc
  collect=$("$PY" -m pytest tests/python -m gpu -k small --collect-only -q 2>&1)
  rc=$?
  if (( rc == 5 )); then
    echo "no GPU tests matching '-m gpu -k small' exist yet: memcheck has nothing to run (not a failure)"
    return 0
  elif (( rc != 0 )); then
    echo "$collect"; echo "collecting the small GPU tests failed (exit $rc)"; return "$rc"
  fi
  echo "$collect" | tail -n 20
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 MACHMOE_REQUIRE_GPU=1 \
    "$cs" --tool memcheck --report-api-errors no --error-exitcode 97 \
    "$PY" -m pytest tests/python -m gpu -k small -q -p no:cacheprovider || return $?
  # Racecheck (shared-memory hazards) on the GEMM engine's small cases: the kernels whose shared
  # memory is written by cp.async, TMA and st.shared and read by wgmma under mbarrier hand-offs.
  echo "== racecheck: small GEMM cases"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 MACHMOE_REQUIRE_GPU=1 \
    "$cs" --tool racecheck --racecheck-report hazard --report-api-errors no --error-exitcode 98 \
    "$PY" -m pytest tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py -m gpu -k small -q \
    -p no:cacheprovider
}
export -f sanitize
run_step sanitizer "$MACHMOE_OUT_DIR/sanitizer.log" "$(timeout_for 150 60)" sanitize

# ---------------------------------------------------------------- benchmark
# expandable segments: fewer fragmentation OOMs when big configs follow each other.
# MACHMOE_REQUIRE_GPU=1: no silent CPU demo if the GPU is not visible.
run_bench() {
  MACHMOE_REQUIRE_GPU=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
    "$PY" -m machmoe.bench --out "$MACHMOE_OUT_DIR" "$@"
}
export -f run_bench
run_step bench "$MACHMOE_OUT_DIR/bench.log" "$(timeout_for 400 15)" run_bench "$@"

# ---------------------------------------------------------------- summary
{
  echo
  echo "gpu_check summary ($(( SECONDS - t_start ))s total, logs in $MACHMOE_OUT_DIR)"
  printf '%-10s %-28s %6s  %s\n' step status seconds log
  for i in "${!step_names[@]}"; do
    printf '%-10s %-28s %6s  %s\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}" "${step_logs[$i]}"
  done
  if [[ -f "$MACHMOE_OUT_DIR/bench.md" ]]; then
    echo
    grep -E '^(GPU:|Ceilings|\| )' "$MACHMOE_OUT_DIR/bench.md" | cut -c1-400
  fi
  echo
  if (( failed )); then echo "RESULT: FAILED"; else echo "RESULT: OK"; fi
} | tee "$MACHMOE_OUT_DIR/summary.txt"
exit "$failed"
