#!/usr/bin/env bash
# A/B of kernel changes on an H100/H200 machine, in one run: the working tree as it is (A) against
# variants, each the same tree with a patch applied. Prints and writes $MACHMOE_OUT_DIR/ab.log:
#   1. A and every patched tree built at once (the library and the torch ops only, no C++ tests;
#      A in ./build, patch P in /tmp/machmoe_ab_P/build);
#   2. each variant's GPU GEMM, layer and backward tests (pytest, MACHMOE_REQUIRE_GPU=1), run side
#      by side, then racecheck on the small GEMM cases: a variant that is wrong is not timed;
#   3. the kernel table (machmoe.bench.gemm_kernels: dense 8192³ with cuBLAS and the six expert
#      GEMMs of 7B-a and 30B-b) for A, B, C, ..., A, B, C, ... (AB_REPS rounds, default 2). GPUs
#      of the same model differ by up to ~10%: compare variants only within one run;
#   4. with AB_LAYER="7B-a,30B-b" (config names), the layer benchmark of each (machmoe only);
#   5. with AB_FP8="7B-a,30B-b", the FP8 layer's forward + backward beside bf16 for each
#      (machmoe.bench.fp8_gemm --rows layer), the variants interleaved, AB_FP8_REPS rounds (1).
#
# Usage, locally:   git diff main my-branch -- src include > my_change.patch
#        on the GPU: MACHMOE_OUT_DIR=/some/dir scripts/gpu_ab.sh my_change.patch [other.patch ...]
# Environment: AB_REPS, AB_LAYER, AB_SKIP_TESTS=1 (timing only, for variants already verified),
#   AB_TESTS=gemm (a screening: only the GEMM test files, no racecheck; verify a winner in full),
#   AB_TESTS=fp8 (the FP8 GPU test files instead, no racecheck; AB_REPS=0 skips the bf16 kernel table),
#   MACHMOE_KERNEL_ROWS / MACHMOE_KERNEL_CONFIGS (which rows and configs the kernel table times).
set -uo pipefail

(( $# )) || { echo "usage: scripts/gpu_ab.sh PATCH..."; exit 2; }
patches=("$@")
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_ab_out
log=$MACHMOE_OUT_DIR/ab.log
: > "$log"
aux=/tmp/machmoe_ab_logs   # build/test/layer logs stay here; failures are quoted into ab.log
rm -rf "$aux" && mkdir -p "$aux"
say() { echo "$*" | tee -a "$log"; }

# Variant i: labels[i], trees[i] (its repository root).
labels=(A); trees=("$root")
for patch in "${patches[@]}"; do
  [[ -f $patch ]] || { say "gpu_ab: no patch file $patch"; exit 2; }
  name=$(basename "$patch" .patch)
  tree=/tmp/machmoe_ab_$name
  rm -rf "$tree" && mkdir -p "$tree"
  tar --exclude=./build --exclude=./.venv --exclude=./.git -cf - . | (cd "$tree" && tar xf -)
  (cd "$tree" && { patch -p1 --quiet < "$root/$patch" || git apply "$root/$patch"; }) ||
    { say "gpu_ab: $patch does not apply to this tree"; exit 2; }
  labels+=("$name"); trees+=("$tree")
done

say "gpu_ab: A = $root (commit ${MACHMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}), variants: ${labels[*]:1}, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$log"

# Builds: every tree at once, the cores shared out.
share=$(( MACHMOE_JOBS / ${#trees[@]} )); (( share >= 1 )) || share=1
pids=()
for i in "${!trees[@]}"; do
  (MACHMOE_JOBS=$share MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" "${trees[$i]}/scripts/build.sh" \
    > "$aux/build_$i.log" 2>&1) &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { failed=1; say "build failed: ${labels[$i]}"; grep -m5 -i error "$aux/build_$i.log" | tee -a "$log"; }
done
(( failed == 0 )) || exit 1
say "builds done ($SECONDS s)"

in_variant() {  # in_variant I CMD...: run CMD with variant I's library and package
  local i=$1; shift
  (cd "${trees[$i]}" && env MACHMOE_LIBRARY_DIR="${trees[$i]}/build/lib" PYTHONPATH="${trees[$i]}/python" "$@")
}

ok=(); for (( i = 0; i < ${#labels[@]}; ++i )); do ok+=(1); done
if [[ -z "${AB_SKIP_TESTS:-}" ]]; then
  test_files=(tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py)
  quick=""
  case ${AB_TESTS:-full} in
    gemm) quick=1 ;;
    fp8) quick=1; test_files=(tests/python/test_gpu_fp8.py tests/python/test_gpu_fp8_layer.py) ;;
    *) test_files+=(tests/python/test_gpu_layer.py tests/python/test_gpu_backward.py) ;;
  esac
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  variant_tests() {  # variant_tests I: its pytest files, then (unless a screening) racecheck
    in_variant "$1" env MACHMOE_REQUIRE_GPU=1 timeout 240 "$MACHMOE_PYTHON" -m pytest -q -x "${test_files[@]}" \
      -p no:cacheprovider || return
    [[ -z $quick ]] || return 0
    in_variant "$1" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 MACHMOE_REQUIRE_GPU=1 timeout 180 "$cs" --tool racecheck \
      --racecheck-report hazard --report-api-errors no --error-exitcode 98 "$MACHMOE_PYTHON" -m pytest -q \
      tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py -m gpu -k small -p no:cacheprovider
  }
  pids=()
  for (( i = 1; i < ${#labels[@]}; ++i )); do
    variant_tests "$i" > "$aux/tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for (( i = 1; i < ${#labels[@]}; ++i )); do
    wait "${pids[$((i - 1))]}"; rc=$?
    say "${labels[$i]} tests+racecheck rc=$rc: $(grep -E '(passed|failed|error)' "$aux/tests_$i.log" | head -n 1) / $(grep -m1 'RACECHECK SUMMARY' "$aux/tests_$i.log")"
    if (( rc != 0 )); then ok[i]=0; tail -n 25 "$aux/tests_$i.log" | tee -a "$log"; fi
  done
  say "tests done ($SECONDS s)"
fi

table='from machmoe.bench import gemm_kernels as g; print(g.format_rows(g.run(references=False)))'
for (( rep = 1; rep <= ${AB_REPS:-2}; ++rep )); do
  for (( i = 0; i < ${#labels[@]}; ++i )); do
    (( ok[i] )) || continue
    say "== ${labels[$i]}, round $rep"
    in_variant "$i" timeout 120 "$MACHMOE_PYTHON" -c "$table" 2>&1 | grep -v '^|---' | tee -a "$log"
  done
done

if [[ -n "${AB_LAYER:-}" ]]; then
  for (( i = 0; i < ${#labels[@]}; ++i )); do
    (( ok[i] )) || continue
    say "== layer, ${labels[$i]}"
    in_variant "$i" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 "$MACHMOE_PYTHON" \
      -m machmoe.bench --configs "$AB_LAYER" --impls machmoe --kernels off --out "$aux/layer_$i" > "$aux/layer_$i.log" 2>&1
    grep -E '^\| [0-9A-Za-z.-]+ \| [0-9]+ \|' "$aux/layer_$i/bench.md" | tee -a "$log"
  done
fi
if [[ -n "${AB_FP8:-}" ]]; then
  for (( rep = 1; rep <= ${AB_FP8_REPS:-1}; ++rep )); do
    for (( i = 0; i < ${#labels[@]}; ++i )); do
      (( ok[i] )) || continue
      say "== FP8 layer, ${labels[$i]}, round $rep"
      in_variant "$i" timeout 300 "$MACHMOE_PYTHON" -m machmoe.bench.fp8_gemm --configs "$AB_FP8" --rows layer \
        --min-reps 10 > "$aux/fp8_${i}_$rep.log" 2>&1
      grep -E '^\| [0-9A-Za-z.-]+ layer' "$aux/fp8_${i}_$rep.log" | awk '!seen[$0]++' | tee -a "$log"
    done
  done
fi
say "gpu_ab: done ($SECONDS s)"
