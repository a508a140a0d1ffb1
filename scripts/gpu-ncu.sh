#!/usr/bin/env bash
# Nsight Compute's hardware counters for decode kernels on a GPU (binaries from scripts/gpu-build.sh):
# `calla bench` at context 4096 under ncu, the kernels matching $KERNELS (a regex), $COUNT of them
# after skipping $SKIP matches (past the prompt and the warm-up), with the sections that say where a
# kernel's time goes (stall reasons, issue slots, memory); $EXTRA adds ncu flags. Text report on
# stdout and in $OUT_DIR/ncu.txt (default ./out). ncu runs each profiled kernel alone (serialised,
# caches flushed between its passes), so its durations are a cold kernel's, not the graph's; the
# stall mix is what it is for.
#   usage: [KERNELS=regex] [SKIP=1500] [COUNT=10] scripts/gpu-ncu.sh
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -n "$NCU" ] || { echo "no ncu (Nsight Compute) on this machine"; exit 1; }
echo "ncu: $NCU"
# shellcheck disable=SC2086 # $EXTRA is a list of flags
timeout 500 "$NCU" --clock-control none --target-processes all \
    -k "regex:${KERNELS:-matvec_tc|deltanet_decode|attn_decode}" --launch-skip "${SKIP:-1500}" --launch-count "${COUNT:-10}" \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis ${EXTRA:-} \
    "$BIN_DIR/calla" bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 16 --rounds 1 \
    --context 4096 > "$OUT_DIR/ncu.txt" 2>&1
echo "rc $?"
grep -vE "^(==PROF==|  +---)" "$OUT_DIR/ncu.txt" | grep -E "^  [a-z_0-9]+.*\(|Duration|Elapsed Cycles|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Active Warps Per Scheduler|Eligible Warps|Stall|stall|Executed Ipc A|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Executed Instructions  |Block Size|Grid Size|Waves Per SM|^    (WRN|OPT|INF)" | cut -c1-220 | head -400
