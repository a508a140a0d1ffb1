#!/usr/bin/env bash
# Prompt-path runs on the device in one command (written in session 11) (carry .gpu-bin from
# scripts/gpu-build-all.sh): STEP is a list of
#   dn, layers          the prefill_deltanet / prefill_layers tests (CALLA_REQUIRE_GPU=1)
#   lab, labhalf        lab_prefill 8192 (default / half precision); labsimt with the CUDA-core DeltaNet
#                       kernels; labnocopy, labnomma, labnostore, labdefs (LABDEFS=…) with lab switches
#   e2e                 calla bench at 8K, 32K context, per precision in E2E_PP (default "split half")
#   parity, parityhalf  scripts/gpu-parity.sh, default / with CALLA_PROMPT_PRECISION=$PAR_PP (half)
#   precmix             the fixtures vs CPU (engine_matches_cpu) under half with one group split
# e.g. run(command="STEP='dn lab' scripts/gpu-prefill-steps.sh", carry=[".gpu-bin"])
set -uo pipefail
cd "$(dirname "$0")/.."
export CALLA_KERNEL_CACHE=$PWD/.gpu-bin/kernel-cache CALLA_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "binaries of $(cat .gpu-bin/COMMIT | tr '\n' ' ')"
t() { local name=$1; shift; timeout "${TT:-150}" ".gpu-bin/$name" --ignored --nocapture --test-threads=1 "$@" > "$OUT/$name.log" 2>&1; echo "== $name $*: exit $? $(grep -c '^ok ' "$OUT/$name.log") ok, $(grep -c '^FAIL' "$OUT/$name.log") FAIL"; grep -E '^FAIL|panicked' "$OUT/$name.log" | head -8; }
lab() { timeout 200 .gpu-bin/lab_prefill 8192 > "$OUT/lab-$1.log" 2>&1; echo "== lab $1 (rc $?)"; grep -E 'scan|chunk|states|dn_out|mixer|MoE block|estimate' "$OUT/lab-$1.log" | sort -u | head -12; }
for step in ${STEP:-dn}; do
case $step in
dn) t prefill_deltanet; grep -E 'real|T=1000' "$OUT/prefill_deltanet.log" | head -20 ;;
layers) t prefill_layers ;;
labsimt) CALLA_DN_SCAN=simt lab simt ;;
labnocopy) CALLA_NVRTC_DEFINES=DN_TC_LAB_NO_COPY lab nocopy ;;
labnomma) CALLA_NVRTC_DEFINES=DN_TC_LAB_NO_MMA lab nomma ;;
labnostore) CALLA_NVRTC_DEFINES=DN_TC_LAB_NO_STORE lab nostore ;;
labonepass) CALLA_NVRTC_DEFINES=TF32_LAB_ONE_PASS lab onepass ;;
labdefs) CALLA_NVRTC_DEFINES=$LABDEFS lab "$LABDEFS" ;;
lab) lab tc ;;
labhalf) CALLA_PROMPT_PRECISION=half lab half ;;
parity) (unset CALLA_KERNEL_CACHE; timeout 200 scripts/gpu-parity.sh > "$OUT/parity.log" 2>&1; echo "== parity rc $?"); grep -E 'ALL PASS|FAIL|rows' "$OUT/parity.log" | tail -8 ;;
parityhalf) (unset CALLA_KERNEL_CACHE; CALLA_PROMPT_PRECISION=${PAR_PP:-half} timeout 200 scripts/gpu-parity.sh > "$OUT/parityh.log" 2>&1; echo "== parity half rc $?"); grep -E 'ALL PASS|FAIL|rows|real|transformers' "$OUT/parityh.log" | tail -14 ;;
e2e) for pp in ${E2E_PP:-split half}; do timeout 150 .gpu-bin/calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 8192 --gen-len 64 --context 32768 --rounds 3 $([ "$pp" = default ] || echo "--prompt-precision $pp") > "$OUT/e2e-$pp.log" 2>&1; echo "== e2e $pp rc $?"; grep -iE 'prefill|ttft|decode|peak' "$OUT/e2e-$pp.log" | head -8; done ;;
precmix) for pp in half "half,mixer-in=split" "half,mixer-out=split" "half,experts=split" "half,shared=split" "half,experts-down=split" "half,experts-gate-up=split"; do
    CALLA_FIXTURES=$PWD/tests/fixtures CALLA_PROMPT_PRECISION="$pp" timeout 120 .gpu-bin/gpu-tests --ignored --test-threads=1 --nocapture engine_matches_cpu > "$OUT/prec.log" 2>&1
    echo "== $pp: rc $? $(grep -c PASS "$OUT/prec.log") PASS $(grep -c FAIL "$OUT/prec.log") FAIL"; grep -E 'mlx4.*(prefill|decode)' "$OUT/prec.log" | head -3
    grep -E 'FAIL' "$OUT/prec.log" | grep -v mlx4 | head -3
  done ;;
esac
done
