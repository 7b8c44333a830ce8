#!/usr/bin/env bash
# Nsight Compute profile of the expert GEMMs on the GPU machine, in one device call: builds, then
# for each kernel named (python -m machmoe.bench.ncu_probe: up, upc, down, dh, dx, dw1, dw1c, dw2,
# dense; default
# "dx down upc dense") writes to $OUT/ncu.log
#   - speed of light, memory workload (with the shared-memory table), warp states, launch stats,
#     DRAM bytes, L2 hit rate, tensor-pipe activity, L2 -> SM bytes;
#   - the SASS instructions where the warps were sampled most (source counters).
# What session 4 ran by hand. Unmodified clocks (--clock-control none), one launch per kernel.
#
# Usage: OUT=$OUT scripts/gpu_profile.sh [kernel ...]   (PROFILE_SKIP_BUILD=1 reuses ./build;
#        PROFILE_CONFIG=30B-a runs the kernels at that SPEC config's shapes, default 7B-a;
#        PROFILE_KEEP_CSV=1 also copies each kernel's per-SASS-instruction CSV to $OUT/src_KERNEL.csv)
set -uo pipefail

# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" gpu_profile_out
log=$OUT/ncu.log
: > "$log"
export MACHMOE_LIBRARY_DIR=$root/build/lib PYTHONPATH=$root/python
ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
kernels=("$@")
config=${PROFILE_CONFIG:-7B-a}
(( ${#kernels[@]} )) || kernels=(dx down upc dense)

if [[ -z "${PROFILE_SKIP_BUILD:-}" ]]; then
  scripts/build.sh > "$OUT/build.log" 2>&1 || { echo "gpu_profile: build failed (build.log)" | tee -a "$log"; exit 1; }
fi
echo "gpu_profile: commit ${MACHMOE_COMMIT:-unknown}, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), kernels: ${kernels[*]}" | tee -a "$log"

metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__m_xbar2l1tex_read_bytes.sum
for k in "${kernels[@]}"; do
  echo "===== $k: speed of light, memory, warp states" | tee -a "$log"
  timeout 120 "$ncu_bin" --clock-control none -k regex:sm90_grouped -s 2 -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
    --section LaunchStats --metrics "$metrics" "$MACHMOE_PYTHON" -m machmoe.bench.ncu_probe "$k" --config "$config" >> "$log" 2>&1 \
    || echo "ncu failed for $k (exit $?)" | tee -a "$log"
  echo "===== $k: top SASS by warp samples" | tee -a "$log"
  rep=/tmp/machmoe_profile_$k
  if timeout 120 "$ncu_bin" --clock-control none -k regex:sm90_grouped -s 2 -c 1 --section SourceCounters \
       --section WarpStateStats -f -o "$rep" "$MACHMOE_PYTHON" -m machmoe.bench.ncu_probe "$k" --config "$config" > /dev/null 2>&1 &&
     "$ncu_bin" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>/dev/null; then
    "$MACHMOE_PYTHON" -m machmoe.bench.ncu_probe --top "$rep.csv" >> "$log" 2>&1
    [[ -n "${PROFILE_KEEP_CSV:-}" ]] && cp "$rep.csv" "$OUT/src_$k.csv"
  else
    echo "source counters failed for $k" | tee -a "$log"
  fi
done
grep -E '^=====|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|hmma_cycles|Shared Memory' \
  "$log" | tee "$OUT/summary.txt"
