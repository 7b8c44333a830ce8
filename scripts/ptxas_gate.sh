#!/usr/bin/env bash
# CMake's CUDA compiler launcher for the core library (CMakeLists.txt, MACHMOE_PTXAS_GATE, on by
# default): runs the compile with ptxas's reports on and fails it where
#   - a kernel spills registers (every spill in this library would be one nobody chose), or
#   - ptxas had to insert a warpgroup.arrive before a wgmma (C7519) or serialise the wgmmas
#     (C7520): both follow from a runtime condition around wgmma issue or from accumulators the
#     compiler cannot keep in place, and cost 5% (C7519) to 20% (C7520) of a GEMM (measured on an
#     H100: an early weight-gradient CTA-pair kernel was slower for that reason alone); or
#     serialised every wgmma of a kernel for want of registers while a wgmma group is in flight
#     (C7511) or for accumulators defined by other instructions inside a wgmma pipeline (C7515); or
#   - a kernel has a stack frame: a register array indexed at run time lives in local memory
#     without counting as a spill (a runtime trip count over the gather's row offsets gave a
#     CTA-pair up-projection a 32-byte frame and made it 17-25% slower). No kernel of this library
#     needs one.
# The reports themselves are dropped; every other diagnostic still reaches the build output.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" -Xptxas=-v 2> "$log"
rc=$?
grep -v -E '^ptxas info *: (Compiling|Function properties|Used|Compile time|[0-9]+ bytes gmem)|^ *[0-9]+ bytes stack frame' "$log" >&2
(( rc == 0 )) || exit "$rc"
bad=$(grep -B3 -E 'C7511|C7515|C7519|C7520|[1-9][0-9]* bytes spill (stores|loads)|[1-9][0-9]* bytes stack frame' "$log")
if [[ -n $bad ]]; then
  echo "ptxas gate (scripts/ptxas_gate.sh): a kernel spills registers, has a stack frame (local memory)," \
    "or has its wgmmas fenced/serialised:" >&2
  echo "$bad" >&2
  exit 1
fi
