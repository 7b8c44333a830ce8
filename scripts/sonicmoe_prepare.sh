#!/usr/bin/env bash
# Prepares .sonic/ (git-ignored) for scripts/sonicmoe_compare.sh: SonicMoE's own benchmark, run
# unmodified beside ours on the same GPU. Runs on a machine with network; the GPU machine has none,
# so everything travels in .sonic/ (carry it: the device tool's 64 MiB limit is why the CuTe DSL
# wheel is repacked with xz).
#   - SonicMoE (Dao-AILab/sonic-moe) at 8565e84 and QuACK (Dao-AILab/quack) at 3d0ab3ec, the
#     commit SonicMoE's requirements.txt pins: sources only, never part of machmoe;
#   - nvidia-cutlass-dsl 4.2.1 (pinned by both), cp312 x86_64, unpacked and re-packed as .tar.xz;
#   - cuda-bindings 12.9 (cutlass-dsl 4.2.1 is built against CUDA 12; used only if the GPU
#     machine's own cuda-bindings does not load it).
# Usage: [SONIC_MOE_GIT=DIR] [QUACK_GIT=DIR] scripts/sonicmoe_prepare.sh [PY_VERSION (3.12)]
#   SONIC_MOE_GIT / QUACK_GIT: existing clones (or bare mirrors) holding those commits, for a
#   machine that reaches PyPI but not GitHub; otherwise both are cloned from GitHub.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${1:-3.12}
dst=$root/.sonic
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dst/src"
sonic_git=${SONIC_MOE_GIT:-$tmp/sonic-moe}
quack_git=${QUACK_GIT:-$tmp/quack}
[ -n "${SONIC_MOE_GIT:-}" ] || git clone -q https://github.com/Dao-AILab/sonic-moe "$sonic_git"
[ -n "${QUACK_GIT:-}" ] || git clone -q https://github.com/Dao-AILab/quack "$quack_git"
git -C "$sonic_git" archive 8565e84 sonicmoe benchmarks | tar xf - -C "$dst/src"
git -C "$quack_git" archive 3d0ab3ec2164749caac8f269f771e66a40efd2de quack | tar xf - -C "$dst/src"
plat=(--only-binary=:all: --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
"${PYTHON:-python3}" -m pip download -q --no-deps "${plat[@]}" -d "$tmp/w" nvidia-cutlass-dsl==4.2.1 "cuda-bindings==12.9.*"
mkdir -p "$tmp/x"
(cd "$tmp/x" && unzip -q "$tmp"/w/nvidia_cutlass_dsl-*.whl && tar cf - . | xz -T0 -9 > "$dst/cutlass421.tar.xz")
cp "$tmp"/w/cuda_bindings-*.whl "$dst/"
du -sh "$dst"
