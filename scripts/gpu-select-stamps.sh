#!/usr/bin/env bash
# Where select_token's time goes under each sampling setting: per-warp %globaltimer stamps of the last
# decode step's selection (lab LAB_STAMPS,LAB_GLOBALTIMER; kernels compiled on the device), 4K context.
#   run(command="scripts/gpu-select-stamps.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
export CALLA_NVRTC_DEFINES=LAB_STAMPS,LAB_GLOBALTIMER
export CALLA_KERNEL_CACHE=/tmp/calla-kernels-stamps
for mode in "" "--temperature 1" "--temperature 0.7 --top-p 0.95" "--temperature 0.7 --top-k 40"; do
    echo "== ${mode:-greedy}"
    timeout 200 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 8 \
        --rounds 1 --context 4096 --profile $mode 2>&1 | grep -A9 -E 'lab global times \(select|[Ee]rror' | head -12
done
