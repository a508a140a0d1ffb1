#!/usr/bin/env bash
# scripts/gpu-build.sh, plus the prompt-path test binaries and the prefill lab in the same folder, so
# that one carry (.gpu-bin, < 64 MiB) holds everything a device session runs:
#   .gpu-bin/{calla, gpu-tests, kernel-cache, lab_prefill, prefill_gemm, prefill_deltanet, …}
# On the device: export CALLA_KERNEL_CACHE=$PWD/.gpu-bin/kernel-cache CALLA_REQUIRE_GPU=1, then e.g.
#   .gpu-bin/prefill_deltanet --ignored --nocapture --test-threads=1
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gpu-build.sh > /dev/null
out=$(cargo test --release -p calla-cuda --no-run 2>&1)
cargo build --release -p calla-cuda --example lab_prefill 2>/dev/null
for t in prefill_gemm prefill_deltanet prefill_attention prefill_moe prefill_layers; do
    bin=$(echo "$out" | grep -o "target/release/deps/$t-[0-9a-f]*" | tail -n 1)
    [ -n "$bin" ] || { echo "no binary for $t" >&2; exit 1; }
    cp "$bin" ".gpu-bin/$t"
done
cp target/release/examples/lab_prefill .gpu-bin/
strip .gpu-bin/prefill_* .gpu-bin/lab_prefill
ls -l .gpu-bin
du -sh .gpu-bin
