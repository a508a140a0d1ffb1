#!/usr/bin/env bash
# CUDA correctness, on the GPU machine, in one command; prints one table.
#   (a) every kernel family against the CPU reference on fresh random inputs (odd and real shapes)
#   (b) every committed fixture: prefill logits and 64-step greedy decode, CUDA vs the CPU engine
#   (c) real shapes: a 4-layer model with the real Qwen3.6-35B-A3B dims, made with transformers
#       (scripts/gpu-real-shape.py: needs python3 with torch and transformers), greedy tokens and
#       log-probabilities vs transformers
#   (d) the prompt-path kernels (prefill_* test binaries) against their references
# Needs the binaries of scripts/gpu-build.sh in .gpu-bin/ (BIN_DIR); logs go to $OUT_DIR (./out).
#   usage: scripts/gpu-parity.sh
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
LOGS=$OUT_DIR/parity
mkdir -p "$LOGS"
BIN=$BIN_DIR
export RUST_BACKTRACE=1 CALLA_REQUIRE_GPU=1
REAL=${REAL_SHAPE_DIR:-${TMPDIR:-/tmp}/calla-real-shape}
# CALLA_PROMPT_PRECISION (e.g. mixed) is `calla generate`'s --prompt-precision default here.
echo "prompt precision: ${CALLA_PROMPT_PRECISION:-balanced (default)}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true

# (c)'s model is made with transformers while the Rust checks run.
( PYTHONUNBUFFERED=1 timeout 240 python3 scripts/gpu-real-shape.py "$REAL" 32 > "$LOGS/real-shape-py.log" 2>&1; echo "exit $?" >> "$LOGS/real-shape-py.log" ) &
py_pid=$!

status=0
run_tests() { # name, timeout, test filter args…
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$BIN/gpu-tests" --ignored --test-threads=1 --nocapture "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || { echo "[$name] exit $rc (log: $name.log)"; status=1; }
}
start=$(date +%s)
run_tests kernels 300 --skip engine_
echo "kernel checks: $(( $(date +%s) - start )) s"
start=$(date +%s)
run_tests engine-cpu 180 engine_matches_cpu
echo "engine vs CPU: $(( $(date +%s) - start )) s"
start=$(date +%s)
prefill_status=0
for t in prefill_gemm prefill_deltanet prefill_attention prefill_moe prefill_layers; do
    [ -x "$BIN/$t" ] || { echo "[$t] missing from $BIN (scripts/gpu-build.sh builds it)"; status=1; continue; }
    timeout 200 "$BIN/$t" --ignored --test-threads=1 --nocapture > "$LOGS/$t.log" 2>&1 || { echo "[$t] exit $? (log: $t.log)"; prefill_status=1; }
done
[ $prefill_status -eq 0 ] || status=1
echo "prompt-path kernels: $(( $(date +%s) - start )) s"
# The CLI end to end on every fixture: `calla generate --json` on cuda vs cpu (64 greedy tokens).
start=$(date +%s)
for dir in tests/fixtures/models/*/; do
    name=$(basename "$dir")
    ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('tests/fixtures/goldens/$name.json'))['prompt_ids'])))")
    for dev in cpu cuda; do
        timeout 120 "$BIN/calla" generate --model "$dir" --prompt-ids "$ids" --max-tokens 64 --ignore-eos \
            --logprobs 5 --json --device $dev > "$LOGS/gen-$dev.json" 2>> "$LOGS/generate.log" || echo "generate $name $dev failed" >> "$LOGS/generate.log"
    done
    python3 - "$LOGS/gen-cpu.json" "$LOGS/gen-cuda.json" "$name" >> "$LOGS/cli.log" 2>&1 <<'PY'
import json, sys
try:
    a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
except Exception as e:
    print(f"| calla generate cuda vs cpu: {sys.argv[3]:<27} | --json, 64 tokens | (no output: {e}) | | | FAIL |")
    sys.exit(0)
same = 0
for x, y in zip(a["token_ids"], b["token_ids"]):
    if x != y:
        break
    same += 1
worst = 0.0
for s in range(same):
    ref = {e["id"]: e["logprob"] for e in a["logprobs"][s]}
    for e in b["logprobs"][s]:
        if e["id"] in ref:
            worst = max(worst, abs(ref[e["id"]] - e["logprob"]))
n = len(a["token_ids"])
ok = same == n == len(b["token_ids"]) and worst <= 2e-2 and a["text"] == b["text"]
print(f"| calla generate cuda vs cpu: {sys.argv[3]:<19} | --json, {n} tokens | {same}/{n} | Δlp {worst:.1e} | | {'PASS' if ok else 'FAIL'} |")
PY
done
echo "calla generate cuda vs cpu: $(( $(date +%s) - start )) s"
wait $py_pid
tail -n 3 "$LOGS/real-shape-py.log"
start=$(date +%s)
CALLA_REAL_SHAPE_DIR=$REAL run_tests engine-transformers 120 engine_matches_transformers
echo "engine vs transformers: $(( $(date +%s) - start )) s"

echo
echo "| check                                          | shape                      |  max error |     where | of tol.  |      |"
echo "|------------------------------------------------|----------------------------|-----------:|----------:|---------:|------|"
cat "$LOGS"/kernels.log "$LOGS"/engine-cpu.log "$LOGS"/cli.log "$LOGS"/engine-transformers.log 2>/dev/null | sed -E 's/^test [^ ]+ \.\.\. //' | grep '^| '
echo
grep -h -E '^test .*(ok|FAILED|ignored)$|^test result|panicked|^error' "$LOGS"/kernels.log "$LOGS"/engine-cpu.log "$LOGS"/engine-transformers.log "$LOGS"/prefill_*.log | grep -v '^test result: ok. 0 passed' | head -40
grep -q 'FAIL |' "$LOGS"/*.log && status=1
echo "parity: $([ $status -eq 0 ] && echo ALL PASS || echo FAILURES)"
exit $status
