#!/usr/bin/env bash
# The numbers of docs/performance.md's status table in one run on a GPU (binaries from
# scripts/gpu-build.sh): the decode sweep (512 / 4K / 32K / 128K, with the copy bandwidth and the
# digests), the 8K-prompt run (prefill, TTFT, decode at 32K, peak memory) and the sampling modes at 4K
# (scripts/gpu-sampling.sh). Full outputs in $OUT_DIR (default ./out); the table rows on stdout.
#   usage: scripts/gpu-status-table.sh
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
bench() { timeout 300 "$BIN_DIR/calla" bench --synthetic qwen3.6-35b-a3b --quant q4 "$@"; }
echo "== sweep"
bench --prompt-len 512 --gen-len 64 --sweep --rounds 2 > "$OUT_DIR/sweep.txt" 2>&1
grep -E "^\| |digest|copy|peak" "$OUT_DIR/sweep.txt"
echo "== 8K prompt"
bench --prompt-len 8192 --gen-len 64 --context 32768 --rounds 3 > "$OUT_DIR/prompt-8k.txt" 2>&1
grep -E "^\| |digest|copy|peak|TTFT|prefill" "$OUT_DIR/prompt-8k.txt"
echo "== sampling"
scripts/gpu-sampling.sh > "$OUT_DIR/sampling.txt" 2>&1
grep -E "^==|^\| *[0-9]|digest at|test result|FAIL|panicked" "$OUT_DIR/sampling.txt"
