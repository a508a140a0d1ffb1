#!/usr/bin/env bash
# `calla bench` at the real shape on the GPU machine (binaries from scripts/gpu-build.sh).
#   run(command="scripts/gpu-bench.sh", carry=[".gpu-bin"])
# Extra arguments go to calla bench (default: q4, 512-token prompt, 128 decode tokens at 512 and 4096).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
# kernels compiled by scripts/gpu-build.sh (same cache keys), else compiled here once
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels 2>/dev/null
export CALLA_KERNEL_CACHE=${CALLA_KERNEL_CACHE:-/tmp/calla-kernels}
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 128 --context 4096 --rounds 3)
timeout 150 .gpu-bin/calla bench "${args[@]}" --json > "$LOGS/bench.json" 2> "$LOGS/bench.log"
rc=$?
tail -n 5 "$LOGS/bench.log"
cat "$LOGS/bench.json"
exit $rc
