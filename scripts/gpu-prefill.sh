#!/usr/bin/env bash
# The prompt-path (prefill) kernels on the GPU machine, in two halves:
#
#   scripts/gpu-prefill.sh build   here (no GPU): build the prefill test binaries and the lab,
#                                  stripped, into .gpu-prefill/ (git-ignored via .git/info/exclude),
#                                  and fill .gpu-prefill/kcache with every module's CUBIN (NVRTC 13.0
#                                  for sm_90a, the same cache key the device computes), so the GPU
#                                  run spends no time compiling.
#   scripts/gpu-prefill.sh run     on the device: every prefill test (CALLA_REQUIRE_GPU=1, so a
#                                  missing GPU fails instead of skipping), then the lab at the real
#                                  shape (LAB_T tokens, default 8192; LAB_T=0 skips it). Logs under $OUT.
#   scripts/gpu-prefill.sh e2e CALLA "CONFIG" …
#                                  on the device: `calla bench` end to end at the real shape (q4,
#                                  8192-token prompt) once per CONFIG (extra bench flags, e.g.
#                                  "--prompt-precision split --kv-cache f32"), one row each.
#
# With the device tool:  run(command="scripts/gpu-prefill.sh run", carry=[".gpu-prefill"])
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-prefill
tests=(prefill_gemm prefill_deltanet prefill_attention prefill_moe prefill_layers)

case "${1:-}" in
build)
    set -e
    grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
    out=$(cargo test --release -p calla-cuda --no-run 2>&1)
    cargo build --release -p calla-cuda --example lab_prefill
    rm -rf "$dir" && mkdir -p "$dir/kcache"
    for t in "${tests[@]}"; do
        bin=$(echo "$out" | grep -o "target/release/deps/$t-[0-9a-f]*" | tail -n 1)
        [ -n "$bin" ] || { echo "no binary for $t" >&2; exit 1; }
        cp "$bin" "$dir/$t"
    done
    cp target/release/examples/lab_prefill "$dir/lab_prefill"
    strip "$dir"/prefill_* "$dir/lab_prefill"
    # NVRTC 13.0 here (pip wheel nvidia-cuda-nvrtc==13.0.*): compile every module into the cache.
    lib=${CALLA_CUDA_LIB_DIR:-$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))' 2>/dev/null || echo /tmp/nvrtc-venv/lib/python3.11/site-packages/nvidia/cu13)}
    CALLA_CUDA_LIB_DIR="$lib" CALLA_KERNEL_CACHE="$PWD/$dir/kcache" CALLA_REQUIRE_NVRTC=1 \
        cargo test --release -p calla-cuda --test nvrtc_compile -- --nocapture 2>&1 | grep -E "CUBIN|NVRTC|result"
    git rev-parse --short HEAD > "$dir/COMMIT"
    ls -l "$dir" "$dir/kcache"
    du -sh "$dir"
    ;;
run)
    OUT=${OUT:-/tmp/gpu-prefill-out}
    mkdir -p "$OUT"
    export CALLA_KERNEL_CACHE="$PWD/$dir/kcache" CALLA_REQUIRE_GPU=1 RUST_BACKTRACE=1
    echo "prefill binaries of $(cat $dir/COMMIT 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
    status=0
    for t in "${tests[@]}"; do
        start=$(date +%s)
        timeout "${TEST_TIMEOUT:-150}" "$dir/$t" --ignored --nocapture --test-threads=1 > "$OUT/$t.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || status=1
        echo "== $t: exit $rc in $(( $(date +%s) - start )) s; $(grep -c '^ok  ' "$OUT/$t.log") checks ok, $(grep -c '^FAIL' "$OUT/$t.log") failed"
        grep -E '^FAIL|panicked|error|^test .*FAILED' "$OUT/$t.log" | head -n 12
    done
    if [ "${LAB_T:-8192}" != 0 ]; then
        timeout "${LAB_TIMEOUT:-200}" "$dir/lab_prefill" "${LAB_T:-8192}" > "$OUT/lab.log" 2>&1 || status=1
        cat "$OUT/lab.log"
    fi
    exit $status
    ;;
e2e)
    calla=$2
    shift 2
    OUT=${OUT:-/tmp/gpu-prefill-out}
    mkdir -p "$OUT"
    status=0
    for cfg in "$@"; do
        # shellcheck disable=SC2086 # CONFIG is a list of flags
        if timeout 150 "$calla" bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len "${E2E_T:-8192}" \
            --gen-len "${E2E_GEN:-128}" --rounds 3 $cfg --json > "$OUT/e2e.json" 2> "$OUT/e2e.err"; then
            python3 - "$OUT/e2e.json" "$cfg" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p, d = r["prefill"], r["decode"][0]
print(f"| {sys.argv[2] or '(defaults)':<52} | {p['precision']:<5} | {r['kv_cache']:<4} | {p['chunk']:>5} | "
      f"{p['ttft_ms']:8.1f} ms | {p['tokens_per_s']:7.0f} tok/s | decode {d['tokens_per_s']:.1f} tok/s |")
PY
        else
            status=1
            echo "| $cfg | FAILED: $(tail -n 2 "$OUT/e2e.err" | tr '\n' ' ') |"
        fi
    done
    exit $status
    ;;
*)
    echo "usage: scripts/gpu-prefill.sh build|run|e2e CALLA CONFIG..." >&2
    exit 2
    ;;
esac
