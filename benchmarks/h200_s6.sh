#!/usr/bin/env bash
# Session 6 on the H200 (vLLM 0.24 staged in /tmp/vsite; .whl carried with a fresh fltune
# wheel), one phase per device call; state under /tmp/s6 (kept while the machine is warm).
#   PHASE=lin  issue 12.1: `fltune candidates`, then `linear` calibrated for the model into a
#              copy of the shipped DB (resumable: rerun the phase until "calibrate rc=0"),
#              report of the linear table.
#   PHASE=adj  issue 12.1 / 11.3: model-step adjudication of `linear` (one routed arm against
#              vanilla, kernel profile on), decision into the DB, freeze.
#   PHASE=seam host cost per call of the linear seam (benchmarks/seam_overhead.py).
#   PHASE=host cProfile of prefill 2048, routed linear arm then vanilla (host_profile.py).
#   PHASE=mp   issue 11.2: A/A of vanilla against vanilla with vLLM's multiprocess engine
#              (`--engine-process multiprocess`), the engine users run.
# Knobs: PROFILE (Qwen3.5-0.8B), MAXTOK (8192: the e2e engine's max_num_batched_tokens),
# AUTOTUNE (FLTUNE_AUTOTUNE_MAX_TOKENS, 1 here: one max-autotune compile per shape),
# REPS, SCENARIOS, TIMEOUT.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_CACHE_DIR=/tmp/s6/inductor TRITON_CACHE_DIR=/tmp/s6/triton
export VLLM_CACHE_ROOT=/tmp/s6/vllm FLASHINFER_WORKSPACE_BASE=/tmp/s6/fiws
export FLTUNE_AUTOTUNE_MAX_TOKENS=${AUTOTUNE:-1}
mkdir -p /tmp/s6
P=${PROFILE:-Qwen3.5-0.8B}
DB=/tmp/s6/h200.db
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }
[ -f $DB ] || cp db/NVIDIA-H200_driver-580.159.04.db $DB
case ${PHASE:-lin} in
lin) {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -m fltune candidates --json > "$OUT/candidates.json"
  python3 - "$OUT/candidates.json" <<'PY'
import json, sys
for o in json.load(open(sys.argv[1]))["ops"]:
    if o["op"] in ("linear", "gdn_chunk_prefill", "gdn_decode"):
        for c in o["candidates"]:
            print(o["op"], c["impl_id"], c["qualified"], (c["reason"] or "")[:100])
PY
  el "calibrate linear"
  timeout ${TIMEOUT:-500} python3 -m fltune calibrate --model "$P" --ops linear \
    --max-tokens ${MAXTOK:-8192} --candidate-timeout 300 --db $DB --json > "$OUT/calibrate-linear.json"
  echo "calibrate rc=$?"
  python3 -m fltune report --db $DB --op linear --wide > "$OUT/report-linear.txt" 2>&1
  head -80 "$OUT/report-linear.txt"
  cp $DB "$OUT/"
  el done
} 2>&1 | tee "$OUT/log" ;;
adj) {
  el "adjudicate linear"
  timeout ${TIMEOUT:-560} python3 -m fltune adjudicate --db $DB --model "$P" --ops linear \
    --reps ${REPS:-5} --warmup 1 --scenarios "${SCENARIOS:-decode_b1,decode_b16,prefill_2048}" \
    --out "$OUT/adjudicate" --json > "$OUT/adjudicate.json"
  echo "adjudicate rc=$?"
  python3 -m fltune report --db $DB --wide > "$OUT/report.txt" 2>&1
  sed -n '/decision/,$p' "$OUT/report.txt" | head -40
  cp $DB "$OUT/"
  find "$OUT/adjudicate" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$OUT/log" ;;
seam) {
  # needs the DB with linear (PHASE=lin's $OUT/h200.db, carried back as SEAMDB when cold)
  [ -n "$SEAMDB" ] && cp "$SEAMDB" $DB
  timeout 200 python3 benchmarks/seam_overhead.py --db $DB --out "$OUT/seam_overhead.json"
  echo "seam rc=$?"
} 2>&1 | tee "$OUT/log-seam" ;;
host) {
  # the routed linear arm's extra prefill host time: cProfile per arm (host_profile.py)
  [ -n "$SEAMDB" ] && cp "$SEAMDB" $DB
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  FLTUNE_DB=$DB FLTUNE_ROUTE=ops:linear timeout ${TIMEOUT1:-170} python3 benchmarks/host_profile.py \
    --out "$OUT" --tag linear --prompt-len ${PLEN:-2048}
  echo "linear rc=$?"
  timeout ${TIMEOUT2:-120} python3 benchmarks/host_profile.py --out "$OUT" --tag vanilla \
    --prompt-len ${PLEN:-2048}
  echo "vanilla rc=$?"
  rm -rf "$OUT/model"
} 2>&1 | tee "$OUT/log-host" ;;
mp) {
  el "A/A multiprocess"
  lscpu > "$OUT/lscpu.txt" 2>&1
  timeout ${TIMEOUT:-560} python3 -m fltune bench --e2e --model "$P" --reps ${REPS:-10} \
    --warmup 2 --scenarios "${SCENARIOS:-decode_b1,decode_b16,prefill_2048}" --out "$OUT" \
    --arm vanilla=vanilla --arm aa=vanilla --engine-process multiprocess
  echo "e2e rc=$?"
  find "$OUT" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$OUT/log" ;;
esac
