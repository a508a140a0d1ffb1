#!/usr/bin/env bash
# Decode configurations side by side on the GPU machine (binaries from scripts/gpu-build.sh): one
# `calla bench --profile` per configuration, each a set of environment assignments ('' is the
# default), in the order given, twice over (A B C A B C) so drift shows. Full output in
# $OUT/ab-<i>-<round>.txt; the summary (tok/s, graph step, µs per kernel) on stdout.
#   run(command="scripts/gpu-decode-ab.sh '' 'CALLA_PDL=1'", carry=[".gpu-bin"])
# Environment: CONTEXT (4096), GEN (64), ROUNDS (2: bench rounds), PASSES (2).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
for pass in $(seq 1 "${PASSES:-2}"); do
    i=0
    for cfg in "$@"; do
        i=$((i + 1))
        f="$LOGS/ab-$i-$pass.txt"
        env $cfg timeout 200 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 \
            --gen-len "${GEN:-64}" --rounds "${ROUNDS:-2}" --context "${CONTEXT:-4096}" --profile > "$f" 2>&1
        echo "== [$i] ${cfg:-default} (pass $pass, rc $?)"
        grep -E '^\| *[0-9]' "$f"
        grep -E '^  [a-z_0-9]+ +×|decode step \(graph' "$f" | sed 's/^  /    /'
    done
done
