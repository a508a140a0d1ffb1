#!/usr/bin/env bash
# `calla bench` at the real shape on a GPU (binaries from scripts/gpu-build.sh): the table on
# stderr's tail and the JSON report, both also in $OUT_DIR (default ./out).
#   usage: scripts/gpu-bench.sh [calla bench flags…]
# Default flags: q4, 512-token prompt, 128 decode tokens at context 4096, 3 rounds.
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 128 --context 4096 --rounds 3)
timeout 300 "$BIN_DIR/calla" bench "${args[@]}" --json > "$OUT_DIR/bench.json" 2> "$OUT_DIR/bench.log"
rc=$?
tail -n 5 "$OUT_DIR/bench.log"
cat "$OUT_DIR/bench.json"
exit $rc
