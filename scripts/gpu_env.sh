# shellcheck shell=bash
# Sourced by the GPU-machine scripts (gpu_check.sh, gpu_ab.sh): the shared preamble.
# Usage: source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" DEFAULT_OUT_NAME
# Sets root (the repository, also the working directory) and exports MACHMOE_OUT_DIR, the folder
# the logs go to (created; default $root/DEFAULT_OUT_NAME), and exports the build/Python settings for a machine without network:
# the GPU machine's python3 already has torch/numpy/pytest, so scripts/setup.sh must never try to
# create a virtual environment there.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
export MACHMOE_OUT_DIR=${MACHMOE_OUT_DIR:-$root/${1:?gpu_env.sh: name the default output folder}}
mkdir -p "$MACHMOE_OUT_DIR"
export PYTHONUNBUFFERED=1
export MACHMOE_PYTHON=${MACHMOE_PYTHON:-$(command -v python3)}
export MACHMOE_JOBS=${MACHMOE_JOBS:-$(nproc)}
