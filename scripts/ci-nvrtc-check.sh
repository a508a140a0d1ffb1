#!/usr/bin/env bash
# CI, no GPU: every CUDA kernel source compiles under NVRTC 13.0 for sm_90a.
# Installs the NVRTC wheel (PyPI `nvidia-cuda-nvrtc`, 13.0.x: the GPU machine's driver is CUDA 13.0)
# into a virtual environment, points the loader at its lib directory, and runs the calla-cuda test
# that compiles every kernels/*.cu exactly as the engine does at start-up.
#   usage: scripts/ci-nvrtc-check.sh [VENV]   (default .venv-nvrtc; scripts/test.sh passes its own)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-nvrtc}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.*"
lib=$(dirname "$(find -L "$venv" -name 'libnvrtc.so.13' -path '*nvidia*' | head -n 1)")
if [ ! -f "$lib/libnvrtc.so.13" ] || [ ! -f "$lib/libnvrtc-builtins.so.13.0" ]; then
    echo "ci-nvrtc-check: libnvrtc.so.13 / libnvrtc-builtins.so.13.0 not found in $venv" >&2
    exit 1
fi
lib=$(cd "$lib" && pwd)
echo "NVRTC from $lib"
CALLA_REQUIRE_NVRTC=1 CALLA_CUDA_LIB_DIR="$lib" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --release -p calla-cuda --test nvrtc_compile -- --nocapture
