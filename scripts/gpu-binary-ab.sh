#!/usr/bin/env bash
# Greedy decode at 4K, two builds interleaved, three passes each: whether a change moved the step
# beyond the ~0.5% that separate runs of one binary on different machines. .gpu-ab/ holds calla-a.gz
# and calla-b.gz (gzip of two scripts/gpu-build.sh binaries, e.g. one built in a worktree at the older
# commit), COMMIT-a / COMMIT-b, and one kernel-cache with both builds' cubins (keys are source hashes).
#   run(command="scripts/gpu-binary-ab.sh", carry=[".gpu-ab"])
set -uo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/calla-kernels /tmp/calla-ab && mkdir -p /tmp/calla-ab && cp -r .gpu-ab/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
for x in a b; do gunzip -c .gpu-ab/calla-$x.gz > /tmp/calla-ab/calla-$x && chmod +x /tmp/calla-ab/calla-$x; done
for pass in 1 2 3; do
    for x in a b; do
        printf "%s %s pass %s: " "$x" "$(cat .gpu-ab/COMMIT-$x | tr '\n' ' ')" "$pass"
        timeout 120 /tmp/calla-ab/calla-$x bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 \
            --gen-len 64 --context 4096 --rounds 2 2>&1 | grep -E "^\| +4096" || echo "failed"
    done
done
