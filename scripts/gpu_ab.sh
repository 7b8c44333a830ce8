#!/usr/bin/env bash
# A/B of a kernel change on the GPU machine, in one device call: the working tree as it is (A,
# usually main) against the same tree with a patch applied (B). What session 4 ran five times by
# hand. Prints and writes $OUT/ab.log:
#   1. both trees built at once (A in ./build, B in /tmp/machmoe_ab_b/build);
#   2. B's GPU GEMM, layer and backward tests (pytest, MACHMOE_REQUIRE_GPU=1), then racecheck on
#      the small GEMM cases: a variant that is wrong is not timed;
#   3. the kernel table (python -m machmoe.bench.gemm_kernels rows: dense 8192³ with cuBLAS, the
#      six expert GEMMs of 7B-a and 30B-b) for A, B, A, B, ... (AB_REPS rounds, default 2): compare
#      A and B only within this call (lent machines differ by up to ~10%);
#   4. with AB_LAYER="7B-a,30B-b" (config names), the layer benchmark of both (machmoe only).
#
# Usage, locally:   git diff main my-branch -- src include > ab.patch   (untracked, travels along)
#        on device: OUT=$OUT scripts/gpu_ab.sh ab.patch
# Environment: AB_REPS, AB_LAYER, AB_SKIP_TESTS=1 (timing only, for a variant already verified),
#   AB_ENV_B="NAME=VALUE ..." (set for every B run, tests included: a branch's runtime knob, e.g.
#   AB_ENV_B="MACHMOE_GEMM_L2HINTS=3").
set -uo pipefail

patch_file=${1:?usage: scripts/gpu_ab.sh PATCH (a diff of the B variant against this tree)}
[[ -f "$patch_file" ]] || { echo "gpu_ab: no patch file $patch_file"; exit 2; }
patch_file=$(cd "$(dirname "$patch_file")" && pwd)/$(basename "$patch_file")
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_ab_out
log=$OUT/ab.log
: > "$log"
b_root=/tmp/machmoe_ab_b
say() { echo "$*" | tee -a "$log"; }

say "gpu_ab: A = $root (commit ${MACHMOE_COMMIT:-unknown}), B = A + $(basename "$patch_file") ${AB_ENV_B:+with $AB_ENV_B}, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$log"

rm -rf "$b_root" && mkdir -p "$b_root"
tar --exclude=./build --exclude=./.venv --exclude=./.git -cf - . | (cd "$b_root" && tar xf -)
if ! (cd "$b_root" && patch -p1 --quiet < "$patch_file"); then
  say "gpu_ab: the patch does not apply to this tree"; exit 2
fi
half=$(( (MACHMOE_JOBS + 1) / 2 ))
(MACHMOE_JOBS=$half "$b_root/scripts/build.sh" > "$OUT/build_b.log" 2>&1) &
b_pid=$!
MACHMOE_JOBS=$half scripts/build.sh > "$OUT/build_a.log" 2>&1
a_rc=$?
wait "$b_pid"
b_rc=$?
say "build A rc=$a_rc, B rc=$b_rc"
(( a_rc == 0 && b_rc == 0 )) || { grep -m5 -i error "$OUT"/build_*.log | tee -a "$log"; exit 1; }

lib() { if [[ $1 == A ]]; then echo "$root"; else echo "$b_root"; fi; }
in_tree() {  # in_tree A|B CMD...: run CMD with that tree's library and package (B: and AB_ENV_B)
  local v=$1 t; t=$(lib "$1"); shift
  local -a extra=()
  # shellcheck disable=SC2206  # AB_ENV_B is a list of NAME=VALUE words
  [[ $v == B && -n "${AB_ENV_B:-}" ]] && extra=(${AB_ENV_B})
  env MACHMOE_LIBRARY_DIR="$t/build/lib" PYTHONPATH="$t/python" "${extra[@]}" "$@"
}

if [[ -z "${AB_SKIP_TESTS:-}" ]]; then
  (cd "$b_root" && in_tree B env MACHMOE_REQUIRE_GPU=1 timeout 150 "$MACHMOE_PYTHON" -m pytest -q -x \
    tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py tests/python/test_gpu_layer.py \
    tests/python/test_gpu_backward.py -p no:cacheprovider) > "$OUT/tests_b.log" 2>&1
  rc=$?
  say "B tests rc=$rc: $(tail -n 1 "$OUT/tests_b.log")"
  (( rc == 0 )) || { tail -n 30 "$OUT/tests_b.log" | tee -a "$log"; exit 1; }
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  (cd "$b_root" && in_tree B env PYTORCH_NO_CUDA_MEMORY_CACHING=1 MACHMOE_REQUIRE_GPU=1 timeout 120 "$cs" --tool racecheck \
    --racecheck-report hazard --report-api-errors no --error-exitcode 98 "$MACHMOE_PYTHON" -m pytest -q \
    tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py -m gpu -k small -p no:cacheprovider) \
    > "$OUT/racecheck_b.log" 2>&1
  rc=$?
  say "B racecheck rc=$rc: $(grep -m1 'RACECHECK SUMMARY' "$OUT/racecheck_b.log")"
  (( rc == 0 )) || exit 1
fi

table='from machmoe.bench import gemm_kernels as g; print(g.format_rows(g.run()))'
for (( rep = 1; rep <= ${AB_REPS:-2}; ++rep )); do
  for v in A B; do
    say "== $v, round $rep"
    (cd "$(lib $v)" && in_tree "$v" timeout 120 "$MACHMOE_PYTHON" -c "$table") 2>&1 | grep -v '^|---' | tee -a "$log"
  done
done

if [[ -n "${AB_LAYER:-}" ]]; then
  for v in A B; do
    say "== layer, $v"
    (cd "$(lib $v)" && in_tree "$v" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 "$MACHMOE_PYTHON" \
      -m machmoe.bench --configs "$AB_LAYER" --impls machmoe --kernels off --out "$OUT/layer_$v") > "$OUT/layer_$v.log" 2>&1
    grep -E '^\| [0-9A-Za-z.-]+ \| [0-9]+ \|' "$OUT/layer_$v/bench.md" | tee -a "$log"
  done
fi
say "gpu_ab: done"
