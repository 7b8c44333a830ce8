#!/usr/bin/env bash
# Chooses the Python that machmoe builds and tests with, creating it when needed, and prints its
# path on stdout (everything else goes to stderr).
#   1. $MACHMOE_PYTHON if set;
#   2. else ./.venv or the system python3 if it already has the pinned torch, numpy and pytest
#      (the GPU machine has them and no network);
#   3. else a fresh ./.venv with requirements.txt installed from PyPI.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${MACHMOE_PYTHON:-}" ]; then command -v "$MACHMOE_PYTHON" || { echo "machmoe setup: MACHMOE_PYTHON=$MACHMOE_PYTHON not found" >&2; exit 1; }; exit 0; fi
want_torch=$(sed -n 's/^torch==//p' "$root/requirements.txt")

usable() {  # $1: a python executable
  command -v "$1" >/dev/null 2>&1 || return 1
  "$1" -c "
import sys, torch, numpy, pytest
sys.exit(0 if torch.__version__.split('+')[0] == '$want_torch' else 1)" >/dev/null 2>&1
}

for py in "$root/.venv/bin/python" python3; do
  if usable "$py"; then command -v "$py"; exit 0; fi
done

echo "machmoe setup: creating $root/.venv and installing requirements.txt (PyTorch $want_torch)" >&2
python3 -m venv "$root/.venv" >&2
"$root/.venv/bin/python" -m pip install -q --upgrade pip >&2
"$root/.venv/bin/python" -m pip install -q -r "$root/requirements.txt" >&2
usable "$root/.venv/bin/python" || { echo "machmoe setup: .venv is not usable after install" >&2; exit 1; }
echo "$root/.venv/bin/python"
