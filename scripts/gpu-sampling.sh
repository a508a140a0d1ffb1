#!/usr/bin/env bash
# Decode speed under the sampling settings chat clients use, against greedy, at context 4096 on the
# synthetic model (binaries from scripts/gpu-build.sh), with select_token's time from the per-kernel
# profile; then the GPU selection against the reference sampler, and two steps in flight while
# sampling. The synthetic model's logits are flat, so a nucleus rarely fits in the sampler's 64
# candidates: the worst case of the exact top-p path.
#   usage: scripts/gpu-sampling.sh
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
for mode in "" "--temperature 1" "--temperature 0.7 --top-p 0.95" "--temperature 0.7 --top-k 40"; do
    echo "== ${mode:-greedy}"
    # shellcheck disable=SC2086 # $mode is a list of flags
    timeout 200 "$BIN_DIR/calla" bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 --gen-len 32 \
        --rounds 2 --context 4096 --profile $mode 2>&1 | grep -E "^\| *[0-9]|digest at|select_token|[Ee]rror"
done
timeout 300 "$BIN_DIR/gpu-tests" --ignored --test-threads=1 --nocapture selection_matches two_steps_in_flight 2>&1 \
    | grep -E "^\| |test result|panicked|FAIL" | grep -vE "PASS \|$" | head -30
