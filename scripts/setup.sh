#!/usr/bin/env bash
# Sets up the Python environment that machmoe builds, tests and runs with, and prints that Python's
# path on stdout (every message goes to stderr, with the time, so a long download is never silent).
#
# Which Python:
#   1. $MACHMOE_PYTHON if set, used as it is: nothing is created or installed (the GPU-machine
#      scripts set it to a python3 that already has PyTorch, on a machine without network).
#   2. ./.venv when it already has a PyTorch in the supported range (pyproject.toml's
#      dependencies), numpy and pytest.
#   3. Otherwise ./.venv is created:
#      - when python3 already has a PyTorch in that range, the venv sees python3's packages
#        (--system-site-packages) and nothing is downloaded but what is missing (pytest, say);
#      - else the pinned development set (requirements.txt) is installed from PyPI. PyTorch comes
#        from PyTorch's CPU index (about 200 MB) when there is no NVIDIA GPU and that index answers
#        within a few seconds; otherwise from PyPI, whose Linux wheel is the CUDA build (about
#        2.8 GB to download with its NVIDIA libraries, 4.6 GB installed).
# In ./.venv, machmoe is installed in editable form without compiling anything: a .pth file puts
# python/ on the path, and the package loads the op library that scripts/build.sh builds in
# build/lib. `source .venv/bin/activate` then gives `import machmoe`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.venv
cpu_index=https://download.pytorch.org/whl/cpu

say() { echo "[$(date +%H:%M:%S)] machmoe setup: $*" >&2; }

if [ -n "${MACHMOE_PYTHON:-}" ]; then
  command -v "$MACHMOE_PYTHON" || { say "MACHMOE_PYTHON=$MACHMOE_PYTHON not found"; exit 1; }
  exit 0
fi

# The supported PyTorch range, e.g. ">=2.10,<2.13", from pyproject.toml's dependencies.
torch_range=$(sed -n 's/^dependencies = \[.*"torch\([^"]*\)".*/\1/p' "$root/pyproject.toml")
pinned_torch=$(sed -n 's/^torch==//p' "$root/requirements.txt")
[ -n "$torch_range" ] && [ -n "$pinned_torch" ] || { say "cannot read the torch range/pin"; exit 1; }

# Exit status 0 when python $1 imports torch in the range (and the modules named in $2).
has_torch() {
  command -v "$1" >/dev/null 2>&1 || return 1
  "$1" - "$torch_range" "${2:-}" >/dev/null 2>&1 <<'EOF'
import importlib, sys
import torch
def key(v):  # "2.11.0+cu130" -> (2, 11, 0)
    return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())
ok = sys.version_info >= (3, 10)
for clause in sys.argv[1].split(","):
    op, ver = (clause[:2], clause[2:]) if clause[:2] in (">=", "<=", "==") else (clause[:1], clause[1:])
    have, want = key(torch.__version__), key(ver)
    ok &= {">=": have >= want, "<=": have <= want, "==": have == want,
           "<": have < want, ">": have > want}[op]
for name in sys.argv[2].split():
    importlib.import_module(name)
sys.exit(0 if ok else 1)
EOF
}

# The editable install: python/ on the venv's path (a .pth file in its site-packages).
link_package() {
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if [ "$(cat "$site/machmoe-dev.pth" 2>/dev/null)" != "$root/python" ]; then
    echo "$root/python" > "$site/machmoe-dev.pth"
    say "machmoe installed in editable form in .venv ($site/machmoe-dev.pth -> python/)"
  fi
}

pip_install() {  # pip with its progress output on stderr
  "$venv/bin/python" -m pip install --progress-bar on "$@" >&2
}

if has_torch "$venv/bin/python" "numpy pytest"; then
  link_package
  echo "$venv/bin/python"
  exit 0
fi

base=$(command -v python3 || true)
[ -n "$base" ] || { say "python3 (3.10 or newer) not found"; exit 1; }
start=$(date +%s)
if [ ! -x "$venv/bin/python" ] && has_torch "$base"; then
  # PyTorch is already there (a GPU machine's preinstalled one, say): reuse it, download nothing.
  say "creating .venv on $base, which already has PyTorch $torch_range (reused, not downloaded)"
  "$base" -m venv --system-site-packages "$venv" >&2
  # When python3 is itself a virtual environment, --system-site-packages shows the interpreter's
  # packages, not that environment's: a .pth adds its site-packages (and runs their .pth files).
  # .pth files load in name order: python3-env.pth after machmoe-dev.pth, so this checkout's
  # python/ comes before any machmoe that environment has.
  base_site=$("$base" -c "import sys, sysconfig; print(sysconfig.get_paths()['purelib'] if sys.prefix != sys.base_prefix else '')")
  if [ -n "$base_site" ]; then
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$base_site')" > "$site/python3-env.pth"
  fi
  missing=()
  for mod in numpy pytest; do
    "$venv/bin/python" -c "import $mod" 2>/dev/null || missing+=("$(grep "^$mod==" "$root/requirements.txt")")
  done
  if [ ${#missing[@]} -gt 0 ]; then say "installing ${missing[*]}"; pip_install "${missing[@]}"; fi
else
  if [ -x "$venv/bin/python" ]; then
    say ".venv has no PyTorch $torch_range (or lacks numpy/pytest): installing requirements.txt into it"
  else
    say "creating .venv ($("$base" --version)) and installing requirements.txt (PyTorch $pinned_torch)"
    "$base" -m venv "$venv" >&2
  fi
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    has_gpu=0
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1
    # `timeout`, not urlopen's own: a name that does not resolve can hang far longer than that.
    if [ "$has_gpu" = 0 ] && timeout 8 "$venv/bin/python" -c "
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$cpu_index" >/dev/null 2>&1; then
      say "no NVIDIA GPU: PyTorch $pinned_torch's CPU build from $cpu_index (about 200 MB)"
      pip_install --index-url "$cpu_index" "torch==$pinned_torch"
    else
      why=$([ "$has_gpu" = 1 ] && echo "NVIDIA GPU found" || echo "PyTorch's CPU index is not reachable")
      say "$why: PyTorch $pinned_torch from PyPI, the CUDA build: about 2.8 GB to download with" \
          "its NVIDIA libraries, 4.6 GB installed (pip shows each download as it goes)"
    fi
  fi
  say "installing requirements.txt"
  pip_install -r "$root/requirements.txt"
fi
has_torch "$venv/bin/python" "numpy pytest" || { say ".venv is not usable after the install"; exit 1; }
link_package
say "ready in $(( $(date +%s) - start )) s: $venv/bin/python (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
echo "$venv/bin/python"
