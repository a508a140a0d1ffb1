#!/usr/bin/env bash
# The persistent decode layer (decode_layer.cu) on the GPU machine: its check against the chain,
# the barrier check, the step time for the chain and the layer kernel, then where a layer's time
# goes: CALLA_LAYER_TIMING=layer makes that layer's launch stamp each phase's end and each barrier's
# exit, per block (SM clock), and `calla bench` prints the medians and maxima.
#   run(command="scripts/gpu-layer-phases.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels 2>/dev/null
export CALLA_KERNEL_CACHE=${CALLA_KERNEL_CACHE:-/tmp/calla-kernels}
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || true
timeout 120 .gpu-bin/gpu-tests --ignored --test-threads=1 --nocapture grid_sync engine_layer_kernel 2>&1 | grep -E '^\| |test result|panicked|rror' | head -20
bench() { timeout 120 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --context 4096 --rounds 2 "$@" 2>&1; }
echo "== chain (default)"; bench --gen-len 64 | grep -E '^\|  +4096'
export CALLA_DECODE=layer
echo "== layer kernel"; bench --gen-len 64 | grep -E '^\|  +4096'
for layer in 4 3; do
    echo "== layer kernel, layer $layer timed"; CALLA_LAYER_TIMING=$layer bench --gen-len 32 | grep -E '^\|  +4096|timed layer|^  '
done
