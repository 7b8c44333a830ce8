#!/usr/bin/env bash
# SonicMoE's own benchmark (benchmarks/moe-cute.py at 8565e84, one broken line dropped) and ours under its
# timing protocol (`python -m machmoe.bench --timing sonic`), on the same GPU in one call, so that
# the layer targets of SPEC §5 can be read against SonicMoE on this board and not only against
# its published H100 figures. Needs .sonic/ from scripts/sonicmoe_prepare.sh (carry it).
# Usage (GPU machine): SONIC_CONFIGS=7B-a,30B-b [SONIC_CHECK=1] [SONIC_SKIP_OURS=1] \
#   OUT=... scripts/sonicmoe_compare.sh
#   SONIC_CHECK=1: SonicMoE's reference check (its printed errors) on the first config.
#   SONIC_TIMEOUT: seconds for all of SonicMoE's configs (default 900; the ones done are kept).
#   SONIC_PROFILE=7B-a,30B-a: also both layers kernel by kernel (machmoe.bench.profile --gaps), all
#     into $OUT/profiles.txt, tabled side by side (python -m machmoe.bench.profile_compare).
#   SONIC_NCU=7B-a: also Nsight Compute on both layers' six expert GEMMs, one launch each
#     (python -m machmoe.bench.ncu_compare): $OUT/ncu_<config>.md, the raw CSVs and $OUT/ncu.log.
#     SONIC_NCU_METRICS (comma-separated) adds metrics; the raw CSVs keep them.
#   SONIC_SASS=7B-a: kernels of each layer (SONIC_SASS_KERNEL="0,2", default 3 = dW2) under Nsight
#     Compute's source counters: its SASS with warp-stall samples per instruction, as CSV.
#   SONIC_KERNELS=7B-a: also both libraries' expert GEMMs in the same sustained loops
#     (python -m machmoe.bench.sonic_kernels): up-projection alone, dH + dW2, dW1 + dX~;
#     $OUT/kernels.md. SONIC_KERNELS_ARGS: more arguments for it (e.g. "--timing sonic").
#   SONIC_IMPLS: our implementations to time (default machmoe; "grouped_mm,dense,machmoe" adds
#   the same-run references of SPEC §4).
# Writes $OUT/sonic_<config>.log, $OUT/ours/bench.json and $OUT/compare.md.
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" sonic_out
configs=${SONIC_CONFIGS-7B-a}  # empty: no benchmark (e.g. SONIC_PROFILE alone)
[ -f .sonic/cutlass421.tar.xz ] || { echo "sonicmoe_compare: .sonic/ missing (scripts/sonicmoe_prepare.sh, then carry .sonic)"; exit 2; }
site=/tmp/sonic_site
if [ ! -d $site/nvidia_cutlass_dsl ]; then
  mkdir -p $site && tar xJf .sonic/cutlass421.tar.xz -C $site || exit 2
fi
base_pp=${PYTHONPATH:-}
export PYTHONPATH=$site/nvidia_cutlass_dsl/python_packages:$root/.sonic/src${base_pp:+:$base_pp}
probe='import cutlass, cutlass.cute, torch; from cuda.bindings import driver; import sonicmoe; print("sonicmoe imports; cutlass", cutlass.__file__)'
if ! python3 -c "$probe" > "$OUT/sonic_import.log" 2>&1; then
  echo "sonicmoe_compare: import failed with the machine's cuda-bindings; trying 12.9" | tee -a "$OUT/sonic_import.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sonic_cb .sonic/cuda_bindings-*.whl >> "$OUT/sonic_import.log" 2>&1
  export PYTHONPATH=/tmp/sonic_cb:$PYTHONPATH
  python3 -c "$probe" >> "$OUT/sonic_import.log" 2>&1 || { cat "$OUT/sonic_import.log"; exit 3; }
fi
cat "$OUT/sonic_import.log"
sonic_pp=$PYTHONPATH  # what imports SonicMoE (with the fallback bindings, if they were needed)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# moe-cute.py at 8565e84 passes is_glu= to MoE(), whose constructor at that commit has no such
# argument (TypeError): the one line is dropped from a copy; nothing else changes.
sed '/is_glu=is_glu(activation),/d' .sonic/src/benchmarks/moe-cute.py > .sonic/src/moe_cute_run.py
check=
[ "${SONIC_CHECK:-0}" = 1 ] && check=1
if [ -n "$configs" ]; then
  # One process per config, as SonicMoE's script is meant to run (each compiles its kernels:
  # 50-150 s per config on the H100 machine). (Session 23 also tried all configs in one process,
  # by a driver removed since: it compiled faster and timed no better.)
  : > "$OUT/sonic_all.log"
  end=$((SECONDS + ${SONIC_TIMEOUT:-900}))
  for c in ${configs//,/ }; do
    left=$((end - SECONDS)); [ $left -gt 10 ] || break
    thiek=$(PYTHONPATH=$root/python python3 -c "from machmoe.bench.configs import CONFIGS_BY_NAME as C; c=C['$c']; print(f'{c.T},{c.d},{c.n},{c.E},{c.K}')") || exit 2
    skip=--skip_test; [ -n "$check" ] && skip= && check=
    t0=$SECONDS
    timeout $left python3 .sonic/src/moe_cute_run.py --thiek "$thiek" $skip > "$OUT/sonic_$c.log" 2>&1
    echo "rc $?" >> "$OUT/sonic_$c.log"; echo "wall $((SECONDS - t0)) s" >> "$OUT/sonic_$c.log"
    cat "$OUT/sonic_$c.log" >> "$OUT/sonic_all.log"
  done
fi
[ ! -f "$OUT/sonic_all.log" ] || grep -E "^T |Average time|rc |wall " "$OUT/sonic_all.log"
if [ ! -f build/lib/libmachmoe_torch.so ] && { [ "${SONIC_SKIP_OURS:-0}" != 1 ] || [ -n "${SONIC_PROFILE:-}${SONIC_NCU:-}${SONIC_KERNELS:-}" ]; }; then
  MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" PYTHONPATH=$base_pp scripts/build.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 4; }
fi
if [ "${SONIC_SKIP_OURS:-0}" != 1 ] && [ -n "$configs" ]; then
  export PYTHONPATH=$root/python${base_pp:+:$base_pp}
  export MACHMOE_LIBRARY_DIR=$root/build/lib MACHMOE_REQUIRE_OPS=1
  python3 -m machmoe.bench --configs "$configs" --impls "${SONIC_IMPLS:-machmoe}" --kernels off --timing sonic \
    --out "$OUT/ours" 2>&1 | tee "$OUT/ours.log"
fi
if [ -n "${SONIC_PROFILE:-}" ]; then
  # Kernel by kernel, both layers on the same inputs (python -m machmoe.bench.profile --gaps).
  export PYTHONPATH=$sonic_pp:$root/python
  export MACHMOE_LIBRARY_DIR=$root/build/lib
  # All profiles go into one file: the device returns at most 8 files from $OUT (session 25 lost
  # four per-profile files that way).
  for c in ${SONIC_PROFILE//,/ }; do
    for impl in sonicmoe machmoe; do
      prof=/tmp/sonic_profile_${impl}_$c.txt
      timeout 300 python3 -m machmoe.bench.profile --config "$c" --impl $impl --iters 5 --warmup-s 2 --gaps --memory \
        --rows 30 > "$prof" 2>&1
      echo "profile $impl $c rc $?"; grep "^== " "$prof"
      { echo "######## profile $impl $c"; cat "$prof"; } >> "$OUT/profiles.txt"
    done
  done
  PYTHONPATH=$root/python python3 -m machmoe.bench.profile_compare "$OUT/profiles.txt"
fi
if [ -n "${SONIC_KERNELS:-}" ]; then
  read -r -a kernels_args <<< "${SONIC_KERNELS_ARGS:-}"
  # Both libraries' kernels in interleaved loops, one process (SonicMoE compiles on its first
  # calls, before a preheat and the first measured loop), so both see the same board state.
  PYTHONPATH=$sonic_pp:$root/python MACHMOE_LIBRARY_DIR=$root/build/lib timeout "${SONIC_KERNELS_TIMEOUT:-420}" \
    python3 -m machmoe.bench.sonic_kernels --configs "$SONIC_KERNELS" "${kernels_args[@]}" 2>&1 | tee "$OUT/kernels.md"
fi
if [ -n "${SONIC_NCU:-}" ]; then
  # Nsight Compute on the six expert GEMMs of each layer's second forward + backward call (the
  # first compiles SonicMoE's kernels): both in launch order up, down, dH, dW2, dW1, dX~.
  export PYTHONPATH=$sonic_pp:$root/python
  export MACHMOE_LIBRARY_DIR=$root/build/lib
  ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
  metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__m_xbar2l1tex_read_bytes.sum
  metrics+=,smsp__inst_executed.sum${SONIC_NCU_METRICS:+,$SONIC_NCU_METRICS}
  for c in ${SONIC_NCU//,/ }; do
    for impl in sonicmoe machmoe; do
      rep=/tmp/sonic_ncu_${impl}_$c
      timeout 400 "$ncu_bin" --clock-control none -k 'regex:HopperWgmma|sm90_grouped' -s 6 -c 6 \
        --section SpeedOfLight --section LaunchStats --section WarpStateStats --metrics "$metrics" -f -o "$rep" \
        python3 -m machmoe.bench.profile --config "$c" --impl $impl --plain-calls 2 > "/tmp/sonic_ncu_${impl}_$c.log" 2>&1
      echo "ncu $impl $c rc $?"
      "$ncu_bin" -i "$rep.ncu-rep" --page raw --csv > "$OUT/ncu_${impl}_$c.csv" 2>> "/tmp/sonic_ncu_${impl}_$c.log"
      cat "/tmp/sonic_ncu_${impl}_$c.log" >> "$OUT/ncu.log"
    done
    python3 -m machmoe.bench.ncu_compare "$c" "$OUT/ncu_sonicmoe_$c.csv" "$OUT/ncu_machmoe_$c.csv" | tee "$OUT/ncu_$c.md"
  done
fi
if [ -n "${SONIC_SASS:-}" ]; then
  # Kernels of each layer's second call under Nsight Compute's source counters: their SASS with
  # the warp-stall samples per instruction ($OUT/sass_<impl>_<config>_k<i>.csv). SONIC_SASS=config,
  # SONIC_SASS_KERNEL = launch indices in up, down, dH, dW2, dW1, dX~ order, comma-separated
  # (default 3: dW2); one profiled process per kernel and layer.
  export PYTHONPATH=$sonic_pp:$root/python
  export MACHMOE_LIBRARY_DIR=$root/build/lib
  ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  c=$SONIC_SASS
  kernels=${SONIC_SASS_KERNEL:-3}
  for k in ${kernels//,/ }; do
    for impl in sonicmoe machmoe; do
      rep=/tmp/sonic_sass_${impl}_${c}_k$k
      log=$rep.log
      timeout 400 "$ncu_bin" --clock-control none -k 'regex:HopperWgmma|sm90_grouped' -s $((6 + k)) -c 1 \
        --section SourceCounters --section WarpStateStats --section LaunchStats -f -o "$rep" \
        python3 -m machmoe.bench.profile --config "$c" --impl $impl --plain-calls 2 > "$log" 2>&1
      echo "ncu sass $impl $c kernel $k rc $?"
      csv=$OUT/sass_${impl}_${c}_k$k.csv
      "$ncu_bin" -i "$rep.ncu-rep" --page source --print-source sass --csv > "$csv" 2>> "$log"
      "$ncu_bin" -i "$rep.ncu-rep" --page details >> "$log" 2>&1
      { echo "######## sass $impl $c kernel $k"; cat "$log"; } >> "$OUT/ncu.log"
      ! command -v xz > /dev/null || xz -f "$csv"
      ls -la "$csv"*
    done
  done
fi
[ -z "$configs" ] || PYTHONPATH=$root/python${base_pp:+:$base_pp} python3 -m machmoe.bench.sonic_compare "$OUT" "$configs" | tee "$OUT/compare.md"
