#!/usr/bin/env bash
# Issue 11 on the H200, in two device calls of under 10 minutes each (PHASE=a, then PHASE=b),
# with vLLM 0.24 staged (../shared/device/stage-vllm.sh: PYTHONPATH=/tmp/vsite) and .whl
# carried with a fresh fltune wheel (`pip wheel --no-deps -w .whl .`).
#   PHASE=a: native.vllm against the real model's kernels (benchmarks/native_in_model.py);
#            the shipped DB re-raced for Qwen3.5-0.8B with native.vllm in every race
#            (`fltune calibrate --force`, into a copy: $OUT/h200.db); the model-step
#            adjudication of the ops that DB would route (`fltune adjudicate`).
#   PHASE=b: the end-to-end instrument on that DB: vanilla, A/A, calibrated (`--db`, default
#            route), fixed FL order (every op routed; NOFL=1 leaves it out)
#            -> $OUT/e2e-summary.json + raw.
# Knobs: PROFILE (model), CALOPS (the ops PHASE=a re-races), REPS, WARMUP, SCENARIOS, TIMEOUT,
# NOADJ / ONLYADJ / NONATIVE / NOCAL (skip parts of PHASE=a), NOFL, EXTRA (more bench flags).
# Both phases keep their DB under /tmp/i11 (the warm machine keeps /tmp between calls) and
# copy it to $OUT.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_CACHE_DIR=/tmp/i11/inductor TRITON_CACHE_DIR=/tmp/i11/triton
export VLLM_CACHE_ROOT=/tmp/i11/vllm
mkdir -p /tmp/i11
P=${PROFILE:-Qwen3.5-0.8B}
DB=/tmp/i11/h200.db
REPS=${REPS:-10}
SC=${SCENARIOS:-decode_b1,decode_b16,decode_b64,prefill_2048,prefill_8192}
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }
case ${PHASE:-a} in
a) {
  [ -n "$ONLYADJ" ] && NONATIVE=1 && NOCAL=1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  [ -f $DB ] || cp db/NVIDIA-H200_driver-580.159.04.db $DB
  el "native vs in-model"
  [ -n "$NONATIVE" ] || VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 240 python3 benchmarks/native_in_model.py \
      --profile "$P" --out "$OUT" --impls native.vllm,inductor.standalone || echo "native_in_model rc=$?"
  el "recalibrate"
  [ -n "$NOCAL" ] || timeout 150 python3 -m fltune calibrate --model "$P" --db $DB --force --quiet --json --ops ${CALOPS:-gemma_rms_norm,gemma_fused_add_rms_norm,rms_norm_gated,silu_and_mul,mrope} \
      > "$OUT/calibrate.json"; echo "calibrate rc=$?"
  python3 -m fltune report --db $DB > "$OUT/report-after-calibrate.txt"
  el "adjudicate"
  left=$(( 570 - ($(date +%s) - t0) ))
  [ $left -lt ${MINADJ:-330} ] && { echo "only $left s left: adjudicate in the next call (ONLYADJ=1)"; NOADJ=1; }
  [ -n "$NOADJ" ] || timeout $left python3 -m fltune adjudicate --db $DB --model "$P" \
      --reps ${AREPS:-6} --scenarios "$SC" --out "$OUT/adjudicate" --json > "$OUT/adjudicate.json"
  echo "adjudicate rc=$?"
  cp $DB "$OUT/"
  python3 -m fltune report --db $DB > "$OUT/report.txt"; tail -40 "$OUT/report.txt"
  el done
} 2>&1 | tee "$OUT/log" ;;
b) {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  [ -f $DB ] || cp db/NVIDIA-H200_driver-580.159.04.db $DB
  python3 -m fltune freeze --db $DB --out "$OUT/manifest-fl.json" --order fl || exit 1
  lscpu > "$OUT/lscpu.txt" 2>&1; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1 | head -1
  # GPU clocks and power beside the run: is a slow repetition the GPU's or the host's?
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,pstate,utilization.gpu \
    --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 & SMI=$!
  el "e2e"
  timeout ${TIMEOUT:-570} python3 -m fltune bench --e2e --model "$P" --reps $REPS \
    --warmup ${WARMUP:-2} --scenarios "$SC" --out "$OUT" \
    --arm vanilla=vanilla --arm aa=vanilla --arm "calibrated=db:$DB" \
    $( [ -n "$NOFL" ] || echo --arm "fl=manifest:$OUT/manifest-fl.json:all" ) $EXTRA
  echo "e2e rc=$?"
  kill $SMI 2>/dev/null
  cp $DB "$OUT/"
  el done
} 2>&1 | tee "$OUT/log" ;;
esac
