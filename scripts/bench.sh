#!/usr/bin/env bash
# The main job (README): builds, then runs the layer benchmark (SPEC §4/§5) on the GPU, or a small
# CPU demo of the layer where there is no GPU. Arguments go to `python -m machmoe.bench`
# (--configs 7B-a,30B-b, --T-scale 0.25, --out DIR, --list).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$("$root/scripts/setup.sh")
build=$("$root/scripts/build.sh")
cd "$root"
export MACHMOE_LIBRARY_DIR="$build/lib" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m machmoe.bench "$@"
