#!/usr/bin/env bash
# One-clock stamps of one decode kernel (LAB_STAMPS, LAB_GLOBALTIMER) under each configuration, on
# the GPU machine (binaries from scripts/gpu-build.sh). Each argument is a comma-separated list of
# extra NVRTC defines ('' for none) that selects the kernel and variant, e.g.
#   run(command="scripts/gpu-stamps.sh MTC_LAB_DN_INPROJ_ONLY MTC_LAB_DN_INPROJ_ONLY,MTC_BULK=0", carry=[".gpu-bin"])
# Environment: CONTEXT (4096). Prints the "lab global times" table of `calla bench --profile`.
set -uo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
for defs in "$@"; do
    echo "== stamps: ${defs:-(none)}"
    CALLA_NVRTC_DEFINES="LAB_STAMPS,LAB_GLOBALTIMER${defs:+,$defs}" timeout 200 .gpu-bin/calla bench \
        --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 16 --rounds 1 \
        --context "${CONTEXT:-4096}" --profile 2>&1 | grep -A10 "lab global"
done
