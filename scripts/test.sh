#!/usr/bin/env bash
# The test command (README; CI runs it through .ci/run): builds, then runs the C++ tests (ctest)
# and the Python tests (pytest). GPU tests skip without a GPU; MACHMOE_REQUIRE_GPU=1 makes them
# fail instead (scripts/gpu_check.sh sets it). Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh")
build=$("$root/scripts/build.sh")
ctest_bin=$([ -f "$(dirname "$py")/ctest" ] && [ -x "$(dirname "$py")/ctest" ] && echo "$(dirname "$py")/ctest" || command -v ctest)
echo "== C++ tests (ctest)"
"$ctest_bin" --test-dir "$build" --output-on-failure -j "$(nproc)"
echo "== C++ package: cmake --install + find_package(machmoe) + examples/cpp"
cmake_bin=$([ -f "$(dirname "$py")/cmake" ] && [ -x "$(dirname "$py")/cmake" ] && echo "$(dirname "$py")/cmake" || command -v cmake)
"$cmake_bin" --install "$build" --prefix "$build/install" > "$build/install.log"
"$cmake_bin" -S "$root/examples/cpp" -B "$build/example" -G Ninja -DCMAKE_PREFIX_PATH="$build/install" \
  -DCMAKE_BUILD_TYPE=Release > "$build/example.log"
"$cmake_bin" --build "$build/example" >> "$build/example.log"
LD_LIBRARY_PATH="$build/install/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$build/example/moe_layer"
echo "== Python tests (pytest)"
cd "$root"
export MACHMOE_LIBRARY_DIR="$build/lib" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export MACHMOE_REQUIRE_OPS=1  # the op library was just built: a test that cannot load it fails
"$py" -m pytest tests/python -q -rs "$@"
