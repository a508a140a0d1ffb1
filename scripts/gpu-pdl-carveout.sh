#!/usr/bin/env bash
# Programmatic launch with one shared-memory carveout for every kernel but attention
# (CALLA_LAB_CARVEOUT=28: the 64 KB split, which the register-path kernels run at without loss,
# session 13): whether programmatic launch lost for every kernel (+343 µs, session 13) because
# neighbouring kernels picked different L1/shared splits (an SM changes its split only when idle, so
# a dependent's early blocks cannot start beside its predecessor's). On the GPU machine:
#   run(command="scripts/gpu-pdl-carveout.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
CARVE="CALLA_LAB_CARVEOUT=${CARVEOUT:-28} CALLA_LAB_CARVEOUT_SKIP=attn_"
PASSES=${PASSES:-2} scripts/gpu-decode-ab.sh \
    '' \
    "$CARVE" \
    "$CARVE CALLA_PDL=1" \
    "CALLA_PDL=1" \
    "$CARVE CALLA_PDL_ONLY=matvec_tc_q4_c2,matvec_tc_down" \
    "$CARVE CALLA_PDL_ONLY=matvec_tc_q4_c2,matvec_tc_headnorm_route,matvec_tc_route" \
    | grep -E "^==|decode step|^\|"
grep -h "digest at" "${OUT:-$PWD/gpu-logs}"/ab-*.txt | sort | uniq -c
