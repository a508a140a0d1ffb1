#!/usr/bin/env bash
# The decode step as one persistent grid with a producer warp (tests/gpu/stream_floor.rs
# decode_chain_with_a_producer_warp), next to the chain of launches it would replace
# (decode_chain_against_its_floor), on the GPU machine; binaries from scripts/gpu-build.sh.
#   run(command="scripts/gpu-producer-lab.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
timeout 240 .gpu-bin/gpu-tests --ignored --nocapture --test-threads 1 decode_chain_with_a_producer_warp 2>&1 | grep -E "^\| (producer|  block|one kernel)|test result|panicked|error"
if [ "${1:-}" = chain ]; then timeout 240 .gpu-bin/gpu-tests --ignored --nocapture --test-threads 1 decode_chain_against_its_floor 2>&1 | grep -E "^\| (chain of [0-9]+ links: (the step|x read|bulk)|one persistent)|test result|panicked|error"; fi
