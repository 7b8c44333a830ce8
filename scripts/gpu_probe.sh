#!/usr/bin/env bash
# Where a grouped GEMM's time goes, in one device call: the kernel table (python -m
# machmoe.bench.gemm_kernels: dense 8192³ and the expert GEMMs of 7B-a and 30B-b) of the normal
# build (./build) beside a build with the timing probes compiled in (-DMACHMOE_GEMM_PROBES=ON, in
# ./build-probe), run with MACHMOE_GEMM_PROBE = each of
#   0 the probe build as is (its own baseline: the probe branches cost it a few per cent)
#   1 no epilogue (the consumers drop the accumulators)   -> main loop: loads + wgmma
#   2 no wgmma                                             -> loads + epilogue
#   4 no loads (stages are "full" at once, stale data)     -> wgmma + epilogue
#   3 loads only, 5 wgmma only, 6 epilogue only
#   8 full tiles staged but not stored (no TMA store of C/H): the store traffic's share
#   16, 32, 64 (dH rows only) the dH epilogue without its H loads (H = 1), its dH stores, its A'
#     stores; 96 = no stores, 112 = compute only (the values are kept live)
#   128 A (gathered or contiguous) loaded for a row block's first column tile only: what keeping
#     A on chip across the column tiles (or CTA pairs sharing it) could save at most
# and writes the milliseconds per kernel as one table, $OUT/probe.md (and probe.log). The probes'
# results are wrong; only their times mean something. Weight-gradient rows are not probed.
# The probe build runs without the ptxas gate: its probe branches make ptxas fence some wgmmas
# (C7519) and spill a few bytes in the dH kernels; its probe-0 column measures what that costs.
#
# With PROBE_POWER="7B-a,dense" (substrings of kernel labels), each run is followed by
# python -m machmoe.bench.power on those kernels: the SM clock, board power and clock-event reasons
# while each runs back to back, into $OUT/power.md.
#
# With PROBE_STAGES4=1, a third build (-DMACHMOE_GEMM_PROBE_EXTRA_STAGE=ON, ./build-probe4) gives
# each grouped GEMM one more operand stage in place of its staged output tile and skips the
# epilogue; its columns "+1 stage: 1" (main loop) and "+1 stage: 3" (loads only) sit beside
# probes 1 and 3 of the probe build: what one more stage is worth to each kernel's main loop.
#
# Usage: OUT=$OUT scripts/gpu_probe.sh   (PROBE_SET="0 1 3 5" picks the probes)
set -uo pipefail

# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_probe_out
log=$OUT/probe.log
: > "$log"
aux=/tmp/machmoe_probe
rm -rf "$aux" && mkdir -p "$aux"
say() { echo "$*" | tee -a "$log"; }
say "gpu_probe: commit ${MACHMOE_COMMIT:-unknown}, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$log"

half=$(( (MACHMOE_JOBS + 1) / 2 ))
(MACHMOE_JOBS=$half MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" scripts/build.sh > "$aux/build.log" 2>&1) &
pid=$!
MACHMOE_JOBS=$half MACHMOE_BUILD_DIR=$root/build-probe MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" \
  scripts/build.sh -DMACHMOE_GEMM_PROBES=ON -DMACHMOE_PTXAS_GATE=OFF > "$aux/build_probe.log" 2>&1
rc=$?
if [[ ${PROBE_STAGES4:-0} == 1 ]]; then
  MACHMOE_JOBS=$half MACHMOE_BUILD_DIR=$root/build-probe4 MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" \
    scripts/build.sh -DMACHMOE_GEMM_PROBES=ON -DMACHMOE_GEMM_PROBE_EXTRA_STAGE=ON -DMACHMOE_PTXAS_GATE=OFF \
    > "$aux/build_probe4.log" 2>&1 || rc=1
fi
wait "$pid" || rc=1
(( rc == 0 )) || { say "gpu_probe: a build failed"; tail -n 20 "$aux"/build*.log | tee -a "$log"; exit 1; }
say "builds done ($SECONDS s)"

table='import json, sys; from machmoe.bench import gemm_kernels as g; json.dump(g.run(references=False), open(sys.argv[1], "w"))'
run_table() {  # run_table NAME LIBDIR [NAME=VALUE]: the kernel rows as JSON in $aux/NAME.json
  local name=$1 lib=$2; shift 2
  env MACHMOE_LIBRARY_DIR="$lib" PYTHONPATH="$root/python" "$@" timeout 120 "$MACHMOE_PYTHON" -c "$table" \
    "$aux/$name.json" >> "$log" 2>&1 || say "gpu_probe: the table for $name failed"
}
power() {  # power TITLE LIBDIR [NAME=VALUE]: clocks and power of the PROBE_POWER kernels
  [[ -n ${PROBE_POWER:-} ]] || return 0
  local title=$1 lib=$2; shift 2
  { echo; echo "### $title"; env MACHMOE_LIBRARY_DIR="$lib" PYTHONPATH="$root/python" "$@" timeout 200 \
      "$MACHMOE_PYTHON" -m machmoe.bench.power --only "$PROBE_POWER" 2>&1; } | tee -a "$OUT/power.md" >> "$log"
}
[[ -n ${PROBE_POWER:-} ]] && : > "$OUT/power.md"
run_table normal "$root/build/lib"
power "normal build" "$root/build/lib"
for probe in ${PROBE_SET:-0 1 8 2 4 3 5 6}; do
  run_table "probe$probe" "$root/build-probe/lib" MACHMOE_GEMM_PROBE="$probe"
  power "probe $probe" "$root/build-probe/lib" MACHMOE_GEMM_PROBE="$probe"
done
cols="${PROBE_SET:-0 1 8 2 4 3 5 6}"
if [[ ${PROBE_STAGES4:-0} == 1 ]]; then
  for probe in 1 3; do  # (the extra-stage build never runs its epilogue: 1 is its main loop)
    run_table "stages4_probe$probe" "$root/build-probe4/lib" MACHMOE_GEMM_PROBE="$probe"
    power "one more stage, probe $probe" "$root/build-probe4/lib" MACHMOE_GEMM_PROBE="$probe"
  done
  cols="$cols s4:1 s4:3"
fi
run_table normal2 "$root/build/lib"

PYTHONPATH="$root/python" "$MACHMOE_PYTHON" -m machmoe.bench.probe_table "$aux" "$cols" \
  | tee "$OUT/probe.md" | tee -a "$log"
[[ -n ${PROBE_POWER:-} ]] && cat "$OUT/power.md"
say "gpu_probe: done ($SECONDS s)"
