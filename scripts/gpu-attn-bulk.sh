#!/usr/bin/env bash
# Attention's K/V ring by bulk copies (lab define ATTN_BULK=1, attention.cu) against the cp.async
# ring: the attention GPU tests in the lab build, then the decode A/B at 32K (twice), 128K and 4K.
# On the GPU machine with the binaries from scripts/gpu-build.sh:
#   run(command="scripts/gpu-attn-bulk.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels CALLA_FIXTURES=$PWD/tests/fixtures
env CALLA_NVRTC_DEFINES=${ATTN_DEFS:-ATTN_BULK=1} CALLA_REQUIRE_GPU=1 timeout 240 .gpu-bin/gpu-tests --ignored --test-threads=1 \
    --nocapture attention > "$LOGS/attn-bulk-tests.log" 2>&1
echo "attention tests (ATTN_BULK=1): rc $?"
grep -E "^\| |test result|panicked" "$LOGS/attn-bulk-tests.log" | grep -vE "PASS \|$" | head -20
grep -cE "PASS \|$" "$LOGS/attn-bulk-tests.log"
for run in "32768 2" "131072 1" "4096 1"; do
    set -- $run
    rm -f "$LOGS"/ab-*.txt
    CONTEXT=$1 PASSES=$2 scripts/gpu-decode-ab.sh '' "CALLA_NVRTC_DEFINES=${ATTN_DEFS:-ATTN_BULK=1}" \
        | grep -E "^==|decode step|attn_decode|^\|"
    grep -h "digest at" "$LOGS"/ab-*.txt | sort | uniq -c
done
