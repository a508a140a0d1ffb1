#!/usr/bin/env bash
# Decode configurations side by side on the GPU machine (binaries from scripts/gpu-build.sh): one
# `calla bench --profile` per configuration, each a set of environment assignments ('' is the
# default), in the order given, twice over (A B C A B C) so drift shows. Full output in
# $OUT/ab-<i>-<round>.txt; the summary (tok/s, graph step, µs per kernel) on stdout.
#   run(command="scripts/gpu-decode-ab.sh '' 'CALLA_PDL=1'", carry=[".gpu-bin"])
# A configuration that starts with bin=DIR runs DIR/calla (with DIR/kernel-cache added to the cache)
# instead of .gpu-bin/calla: two builds side by side, e.g. 'bin=.gpu-old' '' with .gpu-old a copy of
# an older .gpu-bin (carry both; calla.gz and kernel-cache.tar.gz are unpacked here).
# Environment: CONTEXT (4096), GEN (64), ROUNDS (2: bench rounds), PASSES (2), BENCH_ARGS (more bench
# options for every configuration, e.g. "--temperature 0.7 --top-k 20").
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS"
rm -rf /tmp/calla-kernels
[ -d .gpu-bin/kernel-cache ] && cp -r .gpu-bin/kernel-cache /tmp/calla-kernels
export CALLA_KERNEL_CACHE=/tmp/calla-kernels
for cfg in "$@"; do # (a bin=DIR may hold calla.gz and kernel-cache.tar.gz instead: the carry limit)
    case "$cfg" in bin=*) d=${cfg%% *}; d=${d#bin=}
        [ -f "$d/calla.gz" ] && [ ! -f "$d/calla" ] && mkdir -p "/tmp/ab-$d" && gunzip -c "$d/calla.gz" > "/tmp/ab-$d/calla" && chmod +x "/tmp/ab-$d/calla"
        [ -f "$d/kernel-cache.tar.gz" ] && tar xzf "$d/kernel-cache.tar.gz" -C /tmp/calla-kernels --strip-components=1
        [ -d "$d/kernel-cache" ] && cp -rn "$d/kernel-cache/." /tmp/calla-kernels/ ;; esac
done
echo "commit $(cat .gpu-bin/COMMIT 2>/dev/null | tr '\n' ' ')"
for pass in $(seq 1 "${PASSES:-2}"); do
    i=0
    for cfg in "$@"; do
        i=$((i + 1))
        f="$LOGS/ab-$i-$pass.txt"
        bin=.gpu-bin/calla vars=$cfg
        case "$cfg" in bin=*) d=${cfg%% *}; bin=${d#bin=}/calla; vars=${cfg#"$d"}
            [ -f "$bin" ] || bin=/tmp/ab-${d#bin=}/calla ;; esac
        env $vars timeout 200 "$bin" bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 512 \
            --gen-len "${GEN:-64}" --rounds "${ROUNDS:-2}" --context "${CONTEXT:-4096}" --profile ${BENCH_ARGS:-} > "$f" 2>&1
        echo "== [$i] ${cfg:-default} (pass $pass, rc $?)"
        grep -E '^\| *[0-9]' "$f"
        grep -E '^  [a-z_0-9]+ +×|decode step \(graph' "$f" | sed 's/^  /    /'
    done
done
