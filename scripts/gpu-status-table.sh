#!/usr/bin/env bash
# The numbers of docs/performance.md's status table in one run on the GPU machine (binaries from
# scripts/gpu-build.sh): the decode sweep (512 / 4K / 32K / 128K, with the copy bandwidth and the
# digests), the 8K-prompt run (prefill, TTFT, decode at 32K, peak memory) and the sampling modes at 4K
# (scripts/gpu-sampling.sh). Full outputs in $OUT; the table rows on stdout.
#   run(command="scripts/gpu-status-table.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
bench() { timeout 300 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 "$@"; }
echo "== sweep"
bench --prompt-len 512 --gen-len 64 --sweep --rounds 2 > "$LOGS/sweep.txt" 2>&1
grep -E "^\| |digest|copy|peak" "$LOGS/sweep.txt"
echo "== 8K prompt"
bench --prompt-len 8192 --gen-len 64 --context 32768 --rounds 3 > "$LOGS/prompt-8k.txt" 2>&1
grep -E "^\| |digest|copy|peak|TTFT|prefill" "$LOGS/prompt-8k.txt"
echo "== sampling"
scripts/gpu-sampling.sh > "$LOGS/sampling.txt" 2>&1
grep -E "^==|^\| *[0-9]|digest at|test result|FAIL|panicked" "$LOGS/sampling.txt"
