#!/usr/bin/env bash
# The programmatic-launch design's next measurement (docs/performance.md, session 13, "What is left"),
# on the GPU machine with the binaries from scripts/gpu-build.sh: the default against the bulk-copy
# in-projections launched programmatically with their copies before the wait, without and with MoE
# down triggering its dependents only after its own weight loads (MTC_LAB_LATE_TRIGGER), and the late
# trigger alone. Each configuration three times, interleaved (scripts/gpu-decode-ab.sh), then the
# digests (they must all be equal) and the GPU tests of those kernels in the lab build.
#   run(command="scripts/gpu-pdl-bulk.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
BULK_DEFS=MTC_BULK=1,MTC_BULK_TILE=1,MTC_BULK_STAGES=2,MTC_BULK_MAX_CW=2
BULK_ENV="CALLA_LAB_TC_BULK=1 CALLA_LAB_TC_STAGES=2 CALLA_LAB_TC_RESIDENT=2 CALLA_LAB_TC_BULK_MAX_K=2048"
PASSES=${PASSES:-3} scripts/gpu-decode-ab.sh \
    '' \
    "CALLA_NVRTC_DEFINES=$BULK_DEFS $BULK_ENV" \
    "CALLA_NVRTC_DEFINES=$BULK_DEFS,MTC_LAB_LATE_TRIGGER $BULK_ENV" \
    "CALLA_NVRTC_DEFINES=MTC_LAB_LATE_TRIGGER" \
    | grep -E "^==|decode step|matvec_tc_q4_c2|matvec_tc_down|^\|"
grep -h "digest at" "${OUT:-$PWD/gpu-logs}"/ab-*.txt | sort | uniq -c
# the bulk-copy products and MoE down's late trigger against the CPU reference
env CALLA_NVRTC_DEFINES=$BULK_DEFS,MTC_LAB_LATE_TRIGGER $BULK_ENV CALLA_REQUIRE_GPU=1 CALLA_KERNEL_CACHE=/tmp/calla-kernels \
    .gpu-bin/gpu-tests --ignored --test-threads=1 matvec moe_and_mlp fused_routing 2>&1 | grep -E "FAIL|test result|panicked"
