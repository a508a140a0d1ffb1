#!/usr/bin/env bash
# Decode speed under sampling settings a chat client uses, against greedy, at 4K on the synthetic
# model (its logits are flat, so a nucleus rarely fits in the sampler's 64 candidates: the worst case
# of the exact top-p path), with the per-kernel profile (select_token's time under each setting).
#   run(command="scripts/gpu-sampling.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
for mode in "" "--temperature 1" "--temperature 0.7 --top-p 0.95" "--temperature 0.7 --top-k 40"; do
    echo "== ${mode:-greedy}"
    timeout 200 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 32 \
        --rounds 2 --context 4096 --profile $mode 2>&1 | grep -E "^\| *[0-9]|digest at|select_token|decode step \(graph|[Ee]rror"
done
# the selection against the reference sampler, and two steps in flight with sampling
export CALLA_FIXTURES=$PWD/tests/fixtures
timeout 300 .gpu-bin/gpu-tests --ignored --test-threads=1 --nocapture selection_matches two_steps_in_flight 2>&1 \
    | grep -E "^\| |test result|panicked|FAIL" | grep -vE "PASS \|$" | head -30
