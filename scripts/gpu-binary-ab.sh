#!/usr/bin/env bash
# Whether a change moved greedy decode at context 4096 beyond run-to-run noise (~0.5%): two builds,
# interleaved, three passes each. A_DIR and B_DIR are two outputs of scripts/gpu-build.sh (calla or
# calla.gz, COMMIT, kernel-cache), e.g. one made in a worktree at the older commit and copied aside:
#   git worktree add ../calla-old OLD && (cd ../calla-old && scripts/gpu-build.sh) && cp -r ../calla-old/.gpu-bin .gpu-a
#   scripts/gpu-build.sh && cp -r .gpu-bin .gpu-b
#   usage: scripts/gpu-binary-ab.sh A_DIR B_DIR   (default .gpu-a .gpu-b)
set -uo pipefail
cd "$(dirname "$0")/.."
dirs=("${1:-.gpu-a}" "${2:-.gpu-b}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# one cache for both builds: its keys are source hashes, so neither sees the other's kernels
export CALLA_KERNEL_CACHE=${CALLA_KERNEL_CACHE:-$work/kernels}
mkdir -p "$CALLA_KERNEL_CACHE"
for i in 0 1; do
    d=${dirs[$i]}
    if [ -f "$d/calla.gz" ]; then gunzip -c "$d/calla.gz" > "$work/calla-$i"; else cp "$d/calla" "$work/calla-$i"; fi
    chmod +x "$work/calla-$i"
    [ -d "$d/kernel-cache" ] && cp -r "$d/kernel-cache/." "$CALLA_KERNEL_CACHE/"
done
for pass in 1 2 3; do
    for i in 0 1; do
        printf "%s (%s) pass %s: " "${dirs[$i]}" "$(tr '\n' ' ' < "${dirs[$i]}/COMMIT" 2>/dev/null)" "$pass"
        timeout 120 "$work/calla-$i" bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 \
            --gen-len 64 --context 4096 --rounds 2 2>&1 | grep -E "^\| +4096" || echo "failed"
    done
done
