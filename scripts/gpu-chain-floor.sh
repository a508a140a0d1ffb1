#!/usr/bin/env bash
# The decode step's structural floor on the GPU machine (binaries from scripts/gpu-build.sh): the
# lab test decode_chain_against_its_floor (tests/gpu/stream_floor.rs), rows on stdout.
#   run(command="scripts/gpu-chain-floor.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
.gpu-bin/gpu-tests --ignored --nocapture --test-threads 1 decode_chain_against_its_floor 2>&1 | grep -E "^\| (chain|one persistent)|test result|panicked|error"
