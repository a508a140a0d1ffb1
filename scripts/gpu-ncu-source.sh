#!/usr/bin/env bash
# Per-instruction counters (SASS) for decode kernels on the GPU machine (binaries from
# scripts/gpu-build.sh): `calla bench` at 4K under ncu, $COUNT kernels matching $KERNELS after $SKIP
# matches, with the source-level section; the report in $OUT/ncu-source.ncu-rep and, per kernel,
# every SASS instruction with its executed count (and stall samples where the GPU gives them) in
# $OUT/sass-<i>.csv; a per-opcode summary on stdout (scripts/ncu-sass-summary.py).
#   run(command="scripts/gpu-ncu-source.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
timeout 400 "$NCU" --clock-control none -f -o "$LOGS/ncu-source" \
    -k "regex:${KERNELS:-matvec_tc_q4_c2|matvec_tc_gate_up|matvec_tc_down}" --launch-skip "${SKIP:-1500}" --launch-count "${COUNT:-3}" \
    --section SourceCounters --section WarpStateStats --section InstructionStats --section SchedulerStats \
    .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 16 --rounds 1 \
    --context 4096 > "$LOGS/ncu-run.txt" 2>&1
echo "rc $?"
tail -n 3 "$LOGS/ncu-run.txt"
"$NCU" --import "$LOGS/ncu-source.ncu-rep" --print-details all --page details > "$LOGS/ncu-details.txt" 2>&1
for i in $(seq 0 $(( ${COUNT:-3} - 1 ))); do
    "$NCU" --import "$LOGS/ncu-source.ncu-rep" --page source --print-source sass --csv --launch-skip "$i" --launch-count 1 \
        > "$LOGS/sass-$i.csv" 2>&1
    python3 scripts/ncu-sass-summary.py "$LOGS/sass-$i.csv"
done
grep -E "^  [a-z_0-9]+ \(|Stall|stall|Warp Cycles Per Issued" "$LOGS/ncu-details.txt" | cut -c1-200 | head -120
