#!/usr/bin/env bash
# The main job: sets up (scripts/setup.sh), builds (scripts/build.sh), then runs the layer
# benchmark, `python -m machmoe.bench`, on the GPU; without a GPU it says so and runs a small CPU
# demo of the layer. Every argument goes to `python -m machmoe.bench`, which checks them.
# --help and --list answer at once, without building.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"

no_build=0
for arg in "$@"; do
  case $arg in -h|--help|--list) no_build=1 ;; esac
done
if [ "$no_build" = 1 ]; then
  # Any Python already set up will do; none is created just to print the options.
  for py in "${MACHMOE_PYTHON:-}" "$root/.venv/bin/python" python3; do
    # find_spec looks for torch without importing it (an import takes seconds).
    if [ -n "$py" ] && "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then
      echo "scripts/bench.sh: sets up, builds, then runs python -m machmoe.bench with these arguments."
      exec "$py" -m machmoe.bench "$@"
    fi
  done
  echo "scripts/bench.sh [ARGS]: sets up .venv (scripts/setup.sh), builds (scripts/build.sh), then runs"
  echo "python -m machmoe.bench ARGS. No Python environment is set up yet; run scripts/setup.sh"
  echo "(or scripts/bench.sh itself) once, then scripts/bench.sh --help lists the benchmark's options."
  exit 0
fi

py=$("$root/scripts/setup.sh")
# Check the arguments before a build that can take minutes; an error here is argparse's message.
"$py" -c "
import sys
try:
    from machmoe.bench.run import parse_args
except ImportError:
    sys.exit(0)  # checked by the benchmark itself instead
parse_args(sys.argv[1:])" "$@" || exit $?
build=$("$root/scripts/build.sh")
export MACHMOE_LIBRARY_DIR="$build/lib"
exec "$py" -m machmoe.bench "$@"
