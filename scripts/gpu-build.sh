#!/usr/bin/env bash
# Build, here (no GPU needed), what scripts/gpu-parity.sh and scripts/gpu-bench.sh run on the GPU
# machine, which has no Rust: the `calla` binary and the GPU test binary, stripped, in .gpu-bin/
# (git-ignored through .git/info/exclude). Then, with the device tool:
#   run(command="scripts/gpu-parity.sh && scripts/gpu-bench.sh", carry=[".gpu-bin"])
set -euo pipefail
cd "$(dirname "$0")/.."
git_dir=$(git rev-parse --git-common-dir); grep -qx "/.gpu-bin/" "$git_dir/info/exclude" 2>/dev/null || echo "/.gpu-bin/" >> "$git_dir/info/exclude"
cargo build --release -p calla-cli
out=$(cargo test --release -p calla-cuda --test gpu --no-run 2>&1)
echo "$out" | tail -n 3
test_bin=$(echo "$out" | grep -o "[^ (]*release/deps/gpu-[0-9a-f]*" | tail -n 1)
[ -n "$test_bin" ] || { echo "could not find the gpu test binary" >&2; exit 1; }
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp "${CARGO_TARGET_DIR:-target}/release/calla" .gpu-bin/calla
cp "$test_bin" .gpu-bin/gpu-tests
strip .gpu-bin/calla .gpu-bin/gpu-tests
# The kernels compiled here (NVRTC 13.0 wheel, sm_90a) under the same cache keys the engine uses
# there: the GPU machine then loads CUBINs instead of spending its time in NVRTC.
CALLA_KERNEL_CACHE="$PWD/.gpu-bin/kernel-cache" scripts/ci-nvrtc-check.sh .venv-nvrtc > /dev/null
git rev-parse --short HEAD > .gpu-bin/COMMIT
git status --porcelain --untracked-files=no | grep -q . && echo "+dirty" >> .gpu-bin/COMMIT || true
ls -l .gpu-bin
du -sh .gpu-bin
