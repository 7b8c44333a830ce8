#!/usr/bin/env bash
# A/B/C/... of kernel changes on the GPU machine, in one device call: the working tree as it is (A,
# usually main) against variants, each the same tree with a patch applied and/or a runtime knob
# set. Prints and writes $OUT/ab.log:
#   1. A and every patched tree built at once (the library and the torch ops only, no C++ tests;
#      A in ./build, patch P in /tmp/machmoe_ab_P/build);
#   2. each variant's GPU GEMM, layer and backward tests (pytest, MACHMOE_REQUIRE_GPU=1), run
#      side by side, then racecheck on the small GEMM cases: a variant that is wrong is not timed;
#   3. the kernel table (python -m machmoe.bench.gemm_kernels rows: dense 8192³ with cuBLAS, the
#      six expert GEMMs of 7B-a and 30B-b) for A, B, C, ..., A, B, C, ... (AB_REPS rounds, default
#      2): compare variants only within this call (lent machines differ by up to ~10%);
#   4. with AB_LAYER="7B-a,30B-b" (config names), the layer benchmark of each (machmoe only);
#   5. with AB_POWER="7B-a,dense" (substrings of kernel labels), python -m machmoe.bench.power on
#      those kernels for each variant: SM clock, board power, clock-event reasons (docs/PERF.md:
#      the expert GEMMs run at the power cap, so a variant can also win by using less energy);
#   6. with AB_NCU="7B-a dX~" (one kernel-table row), Nsight Compute on that row's third launch for
#      each variant: elapsed cycles, tensor-pipe activity, L2->SM and DRAM bytes, launch shape, the top
#      warp stalls, one table (python -m machmoe.bench.ncu_compare --launches); AB_NCU_METRICS
#      (comma-separated) adds metrics to the profile, and AB_NCU_KEEP=1 copies each variant's raw
#      CSV to $OUT/ncu_I.csv to read here (mind the 8 files that come back); AB_NCU_SASS=1 adds the
#      source counters and writes each variant's SASS with warp-stall samples per instruction to
#      $OUT/sass_I.csv.xz (results/session31/sass_summary.py reads them).
#
# Usage, locally:   git diff main my-branch -- src include > ds.patch   (untracked, travels along)
#        on device: OUT=$OUT scripts/gpu_ab.sh VARIANT...
# VARIANT: PATCH, PATCH@NAME=VALUE[,NAME=VALUE...] (a branch's runtime knob, set for that variant's
#   tests and timings), or @NAME=VALUE[,...] (A's build with a knob). One build per distinct patch.
# Environment: AB_REPS, AB_LAYER, AB_SKIP_TESTS=1 (timing only, for variants already verified),
#   AB_TESTS=gemm (a screening: only the GEMM test files, no racecheck; verify a winner in full).
set -uo pipefail

(( $# )) || { echo "usage: scripts/gpu_ab.sh VARIANT... (PATCH, PATCH@NAME=VALUE,..., or @NAME=VALUE,...)"; exit 2; }
specs=("$@")
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_ab_out
log=$OUT/ab.log
: > "$log"
aux=/tmp/machmoe_ab_logs   # build/test/layer logs stay here (few files may come back from $OUT);
rm -rf "$aux" && mkdir -p "$aux"   # failures are quoted into ab.log
say() { echo "$*" | tee -a "$log"; }

# Variant i: label[i], tree[i] (repository root), envs[i] (space-separated NAME=VALUE words).
labels=(A); trees=("$root"); envs=("")
declare -A patch_tree=()
for spec in "${specs[@]}"; do
  patch=${spec%%@*}; knobs=""
  [[ $spec == *@* ]] && knobs=${spec#*@}
  tree=$root
  if [[ -n $patch ]]; then
    [[ -f $patch ]] || { say "gpu_ab: no patch file $patch"; exit 2; }
    name=$(basename "$patch" .patch)
    tree=/tmp/machmoe_ab_$name
    if [[ -z ${patch_tree[$name]:-} ]]; then
      rm -rf "$tree" && mkdir -p "$tree"
      tar --exclude=./build --exclude=./.venv --exclude=./.git -cf - . | (cd "$tree" && tar xf -)
      (cd "$tree" && { patch -p1 --quiet < "$root/$patch" || git apply "$root/$patch"; }) || { say "gpu_ab: $patch does not apply to this tree"; exit 2; }
      patch_tree[$name]=$tree
    fi
  fi
  labels+=("${patch:+$(basename "$patch" .patch)}${knobs:+@$knobs}")
  trees+=("$tree")
  envs+=("${knobs//,/ }")
done

say "gpu_ab: A = $root (commit ${MACHMOE_COMMIT:-unknown}), variants: ${labels[*]:1}, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$log"

# Builds: A and each distinct patched tree at once, the cores shared out.
build_roots=("$root" "${patch_tree[@]}")
share=$(( MACHMOE_JOBS / ${#build_roots[@]} )); (( share >= 1 )) || share=1
pids=()
for t in "${build_roots[@]}"; do
  (MACHMOE_JOBS=$share MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" "$t/scripts/build.sh" \
    > "$aux/build_$(basename "$t").log" 2>&1 || exit 1) &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { failed=1; say "build failed: ${build_roots[$i]}"; grep -m5 -i error "$aux/build_$(basename "${build_roots[$i]}").log" | tee -a "$log"; }
done
(( failed == 0 )) || exit 1
say "builds done ($SECONDS s)"

in_variant() {  # in_variant I CMD...: run CMD with variant I's library, package and knobs
  local i=$1; shift
  local -a extra=()
  # shellcheck disable=SC2206  # a list of NAME=VALUE words
  [[ -n ${envs[$i]} ]] && extra=(${envs[$i]})
  (cd "${trees[$i]}" && env MACHMOE_LIBRARY_DIR="${trees[$i]}/build/lib" PYTHONPATH="${trees[$i]}/python" "${extra[@]}" "$@")
}

if [[ -z "${AB_SKIP_TESTS:-}" ]]; then
  test_files=(tests/python/test_gpu_gemm.py tests/python/test_gpu_gemm_backward.py)
  quick=""
  if [[ ${AB_TESTS:-full} == gemm ]]; then quick=1
  else test_files+=(tests/python/test_gpu_layer.py tests/python/test_gpu_backward.py); fi
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
  ok=(1)
  for (( i = 1; i < ${#labels[@]}; ++i )); do
    wait "${pids[$((i - 1))]}"; rc=$?
    say "${labels[$i]} tests+racecheck rc=$rc: $(grep -E '(passed|failed|error)' "$aux/tests_$i.log" | head -n 1) / $(grep -m1 'RACECHECK SUMMARY' "$aux/tests_$i.log")"
    if (( rc == 0 )); then ok+=(1); else ok+=(0); tail -n 25 "$aux/tests_$i.log" | tee -a "$log"; fi
  done
  say "tests done ($SECONDS s)"
else
  ok=(); for (( i = 0; i < ${#labels[@]}; ++i )); do ok+=(1); done
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
if [[ -n "${AB_POWER:-}" ]]; then
  for (( i = 0; i < ${#labels[@]}; ++i )); do
    (( ok[i] )) || continue
    say "== power, ${labels[$i]}"
    in_variant "$i" timeout 300 "$MACHMOE_PYTHON" -m machmoe.bench.power --only "$AB_POWER" 2>&1 | grep '^| ' \
      | grep -v '^|---' | tee -a "$log"
  done
fi
if [[ -n "${AB_NCU:-}" ]]; then
  ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__m_xbar2l1tex_read_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum
  [[ -n "${AB_NCU_METRICS:-}" ]] && metrics+=",$AB_NCU_METRICS"
  ncu_files=()
  for (( i = 0; i < ${#labels[@]}; ++i )); do
    (( ok[i] )) || continue
    in_variant "$i" env MACHMOE_KERNEL_ROWS="$AB_NCU" timeout 200 "$ncu_bin" --clock-control none \
      -k regex:sm90_grouped -s 2 -c 1 --section SpeedOfLight --section LaunchStats --section WarpStateStats \
      ${AB_NCU_SASS:+--section SourceCounters} --metrics "$metrics" -f -o "$aux/ncu_$i" "$MACHMOE_PYTHON" -c "$table" \
      > "$aux/ncu_$i.log" 2>&1
    "$ncu_bin" -i "$aux/ncu_$i.ncu-rep" --page raw --csv > "$aux/ncu_$i.csv" 2>> "$aux/ncu_$i.log"
    if [[ -n "${AB_NCU_SASS:-}" ]]; then  # the SASS with warp-stall samples per instruction
      "$ncu_bin" -i "$aux/ncu_$i.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_$i.csv" 2>> "$aux/ncu_$i.log"
      ! command -v xz > /dev/null || xz -f "$OUT/sass_$i.csv"  # (as sonicmoe_compare.sh: plain CSV without xz)
    fi
    ncu_files+=("${labels[$i]}=$aux/ncu_$i.csv")
    [[ -n "${AB_NCU_KEEP:-}" ]] && cp "$aux/ncu_$i.csv" "$OUT/ncu_$i.csv"
  done
  say "== Nsight Compute, $AB_NCU"
  (cd "$root" && PYTHONPATH=$root/python "$MACHMOE_PYTHON" -m machmoe.bench.ncu_compare --launches "${ncu_files[@]}") \
    | tee -a "$log"
fi
say "gpu_ab: done ($SECONDS s)"
