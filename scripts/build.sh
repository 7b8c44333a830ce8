#!/usr/bin/env bash
# Builds machmoe (core library, CPU reference, PyTorch op library, C++ tests) into ./build with
# CMake + Ninja, using the Python chosen by scripts/setup.sh, and prints the build directory on
# stdout (CMake's and Ninja's progress go to stderr). Extra arguments go to the CMake configure step.
#   MACHMOE_BUILD_DIR   build directory (default ./build; the Python package looks in build/lib)
#   MACHMOE_JOBS        parallel compile jobs (default: all cores)
#   MACHMOE_BUILD_TARGETS="machmoe machmoe_torch"  builds only those targets
# A first build compiles every sm_90a kernel: 23 minutes on a busy 2-core machine; later builds
# recompile only what changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh")
bindir=$(dirname "$py")
say() { echo "[$(date +%H:%M:%S)] machmoe build: $*" >&2; }
# Prefer the environment's cmake/ninja (pinned), else the system's.
cmake_bin=$([ -f "$bindir/cmake" ] && [ -x "$bindir/cmake" ] && echo "$bindir/cmake" || command -v cmake)
ninja_bin=$([ -f "$bindir/ninja" ] && [ -x "$bindir/ninja" ] && echo "$bindir/ninja" || command -v ninja)
build=${MACHMOE_BUILD_DIR:-$root/build}
jobs=${MACHMOE_JOBS:-$(nproc)}
targets=()
for t in ${MACHMOE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
# The op library links PyTorch's CUDA libraries: with a CPU-only PyTorch it is not built (the
# pure-PyTorch backend and the C++ library still are). Arguments given to this script come later
# on the command line and so override this.
torch_opts=()
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  say "this PyTorch is a CPU-only build: the PyTorch op library (torch.ops.machmoe) is not built"
  torch_opts=(-DMACHMOE_BUILD_TORCH=OFF)
fi
start=$(date +%s)
say "configuring $build"
"$cmake_bin" -S "$root" -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin" \
  -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$py" "${torch_opts[@]}" "$@" >&2
say "compiling with $jobs jobs (a first build compiles every sm_90a kernel: minutes, see [n/N] below)"
"$cmake_bin" --build "$build" -j "$jobs" "${targets[@]}" >&2
say "done in $(( $(date +%s) - start )) s: $build/lib"
echo "$build"
