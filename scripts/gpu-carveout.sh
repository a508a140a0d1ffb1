#!/usr/bin/env bash
# Whether the bulk-copy in-projections' losses in the graph (session 13: +15…+75 µs per step, +165
# with programmatic launch) come from shared-memory carveout changes between neighbouring kernels
# (an SM changes its L1/shared split only when idle, so a kernel whose blocks need another split
# cannot start beside its predecessor's last blocks): the bulk path with and without programmatic
# launch, each with one carveout for every kernel but attention (CALLA_LAB_CARVEOUT=44: the 100 KB
# split its two blocks per SM need), and the register path with the same carveout. On the GPU
# machine with the binaries from scripts/gpu-build.sh:
#   run(command="scripts/gpu-carveout.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
BULK="CALLA_NVRTC_DEFINES=MTC_BULK=1,MTC_BULK_TILE=1,MTC_BULK_STAGES=2,MTC_BULK_MAX_CW=2 CALLA_LAB_TC_BULK=1 CALLA_LAB_TC_STAGES=2 CALLA_LAB_TC_RESIDENT=2 CALLA_LAB_TC_BULK_MAX_K=2048"
CARVE="CALLA_LAB_CARVEOUT=${CARVEOUT:-44} CALLA_LAB_CARVEOUT_SKIP=attn_"
PASSES=${PASSES:-2} scripts/gpu-decode-ab.sh \
    '' \
    "$BULK" \
    "$BULK $CARVE" \
    "$BULK $CARVE CALLA_PDL=0" \
    "$CARVE" \
    | grep -E "^==|decode step|matvec_tc_q4_c2|^\|"
grep -h "digest at" "${OUT:-$PWD/gpu-logs}"/ab-*.txt | sort | uniq -c
