#!/usr/bin/env bash
# Two decode steps in flight (Backend::step_pipelined, the default of `calla bench`, `generate` and
# `serve`) against one step at a time (`--no-pipeline`), on the GPU machine with the binaries from
# scripts/gpu-build.sh: the GPU test that both choose the same (to the bit), then the sweep both
# ways, interleaved twice (digests must agree across modes: the same kernels in the same order).
#   run(command="scripts/gpu-pipeline.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels CALLA_FIXTURES=$PWD/tests/fixtures
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
timeout 180 .gpu-bin/gpu-tests --ignored --test-threads=1 --nocapture two_steps_in_flight > "$LOGS/pipeline-test.log" 2>&1
echo "pipeline test: rc $?"; grep -E "^\| |test result|panicked" "$LOGS/pipeline-test.log"
for pass in $(seq 1 "${PASSES:-2}"); do
    for mode in "" "--no-pipeline"; do
        f="$LOGS/sweep-${mode:-pipelined}-$pass.txt"
        timeout 300 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 64 \
            --sweep --rounds 2 $mode > "$f" 2>&1
        echo "== ${mode:-pipelined} (pass $pass, rc $?)"
        grep -E "^\| *[0-9]|decode step|digest" "$f"
    done
done
