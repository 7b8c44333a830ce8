#!/usr/bin/env bash
# Builds machmoe (core library, PyTorch ops, C++ tests) into ./build with CMake + Ninja, using the
# Python chosen by scripts/setup.sh. Extra arguments go to the CMake configure step.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh")
bindir=$(dirname "$py")
# Prefer the environment's cmake/ninja (pinned), else the system's.
cmake_bin=$([ -f "$bindir/cmake" ] && [ -x "$bindir/cmake" ] && echo "$bindir/cmake" || command -v cmake)
ninja_bin=$([ -f "$bindir/ninja" ] && [ -x "$bindir/ninja" ] && echo "$bindir/ninja" || command -v ninja)
build=${MACHMOE_BUILD_DIR:-$root/build}
jobs=${MACHMOE_JOBS:-$(nproc)}
# MACHMOE_BUILD_TARGETS="machmoe machmoe_torch" builds only those (scripts/gpu_ab.sh's variants).
targets=()
for t in ${MACHMOE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
"$cmake_bin" -S "$root" -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin" \
  -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$py" "$@" >&2
"$cmake_bin" --build "$build" -j "$jobs" "${targets[@]}" >&2
echo "$build"
