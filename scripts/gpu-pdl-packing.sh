#!/usr/bin/env bash
# Whether programmatic launch of MoE down loses (+95 µs per step with one carveout, session 14)
# because its early blocks pack onto the SMs that gate/up frees first: down's shared memory padded
# so that one block fits per SM (CALLA_LAB_DOWN_SMEM_MIN, with the 64 KB split for every kernel but
# attention), with and without programmatic launch. On the GPU machine:
#   run(command="scripts/gpu-pdl-packing.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
CARVE="CALLA_LAB_CARVEOUT=${CARVEOUT:-28} CALLA_LAB_CARVEOUT_SKIP=attn_"
ONE="CALLA_LAB_DOWN_SMEM_MIN=${DOWN_SMEM:-40960}"
PASSES=${PASSES:-2} scripts/gpu-decode-ab.sh \
    '' \
    "$CARVE CALLA_PDL_ONLY=matvec_tc_q4_c2,matvec_tc_down" \
    "$CARVE $ONE CALLA_PDL_ONLY=matvec_tc_q4_c2,matvec_tc_down" \
    "$CARVE $ONE" \
    | grep -E "^==|decode step|matvec_tc_down|^\|"
grep -h "digest at" "${OUT:-$PWD/gpu-logs}"/ab-*.txt | sort | uniq -c
