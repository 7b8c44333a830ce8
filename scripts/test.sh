#!/usr/bin/env bash
# The test command (README; CI runs it through .ci/run): sets up and builds, then runs the C++
# tests (ctest), installs the C++ package and builds the C++ example against it through
# find_package (both targets, machmoe::machmoe and machmoe::reference), runs the README's Python
# snippets as written, and the Python tests (pytest). GPU tests skip without a GPU;
# MACHMOE_REQUIRE_GPU=1 makes them fail instead (scripts/gpu_check.sh sets it). Extra arguments
# go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "[$(date +%H:%M:%S)] == $*"; }
py=$("$root/scripts/setup.sh")
build=$("$root/scripts/build.sh")
bindir=$(dirname "$py")
ctest_bin=$([ -f "$bindir/ctest" ] && [ -x "$bindir/ctest" ] && echo "$bindir/ctest" || command -v ctest)
cmake_bin=$([ -f "$bindir/cmake" ] && [ -x "$bindir/cmake" ] && echo "$bindir/cmake" || command -v cmake)
ninja_bin=$([ -f "$bindir/ninja" ] && [ -x "$bindir/ninja" ] && echo "$bindir/ninja" || command -v ninja)

say "C++ tests (ctest)"
"$ctest_bin" --test-dir "$build" --output-on-failure -j "$(nproc)"

say "C++ package: cmake --install, then examples/cpp through find_package(machmoe)"
rm -rf "$build/install" "$build/example"  # a fresh install: nothing left from an earlier layout
"$cmake_bin" --install "$build" --prefix "$build/install" > "$build/install.log"
"$cmake_bin" -S "$root/examples/cpp" -B "$build/example" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin" \
  -DCMAKE_PREFIX_PATH="$build/install" -DCMAKE_BUILD_TYPE=Release > "$build/example.log" || { cat "$build/example.log"; exit 1; }
"$cmake_bin" --build "$build/example" >> "$build/example.log" || { cat "$build/example.log"; exit 1; }
LD_LIBRARY_PATH="$build/install/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$build/example/moe_layer"

say "README's Python snippets, as written"
# In the README's environment (.venv, whose .pth finds python/ and the package build/lib) they
# need nothing more; another Python or build directory is pointed at explicitly.
snippet_env=()
[ "$py" = "$root/.venv/bin/python" ] || snippet_env+=("PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}")
[ "$build" = "$root/build" ] || snippet_env+=("MACHMOE_LIBRARY_DIR=$build/lib")
snippets=$(mktemp -d)
awk -v dir="$snippets" '/^```python$/ {n++; f = dir "/readme_" n ".py"; next} /^```$/ {f = ""} f {print > f}' \
  "$root/README.md"
for snippet in "$snippets"/readme_*.py; do
  (cd "$snippets" && env "${snippet_env[@]}" "$py" "$snippet") ||
    { echo "README snippet failed: $snippet"; cat "$snippet"; exit 1; }
done
rm -rf "$snippets"

say "Python tests (pytest)"
cd "$root"
export MACHMOE_LIBRARY_DIR="$build/lib" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
if [ -f "$build/lib/libmachmoe_torch.so" ] && "$py" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
  export MACHMOE_REQUIRE_OPS=1  # the op library was just built: a test that cannot load it fails
fi
"$py" -m pytest tests/python -q -rs "$@"
