#!/usr/bin/env bash
# Build what the GPU scripts run, into .gpu-bin/ (git-ignored): the `calla` binary, the GPU test
# binaries (gpu-tests: kernels, engine and selection checks; prefill_*: the prompt-path kernels),
# stripped, and kernel-cache/ with every kernel module compiled by NVRTC 13.0 for sm_90a (no GPU
# needed; installs the NVRTC wheel as scripts/ci-nvrtc-check.sh does).
#   usage: scripts/gpu-build.sh
# Then, on the GPU machine (the same one, or a copy of this clone with .gpu-bin/: it needs no Rust):
#   scripts/gpu-parity.sh && scripts/gpu-status-table.sh
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
cargo build --release -p calla-cli
out=$(cargo test --release -p calla-cuda --no-run 2>&1)
echo "$out" | tail -n 3
rm -rf .gpu-bin && mkdir -p .gpu-bin
cp "$target/release/calla" .gpu-bin/calla
for t in gpu prefill_gemm prefill_deltanet prefill_attention prefill_moe prefill_layers; do
    bin=$(echo "$out" | grep -o "[^ (]*release/deps/$t-[0-9a-f]*" | tail -n 1)
    [ -n "$bin" ] || { echo "gpu-build: no test binary for $t" >&2; exit 1; }
    name=$t; [ "$t" = gpu ] && name=gpu-tests
    cp "$bin" ".gpu-bin/$name"
done
strip .gpu-bin/*
# The kernels compiled here under the cache keys the engine computes on the GPU machine.
CALLA_KERNEL_CACHE="$PWD/.gpu-bin/kernel-cache" scripts/ci-nvrtc-check.sh .venv-nvrtc > /dev/null
git rev-parse --short HEAD > .gpu-bin/COMMIT
git status --porcelain --untracked-files=no | grep -q . && echo "+dirty" >> .gpu-bin/COMMIT || true
ls -l .gpu-bin
du -sh .gpu-bin
