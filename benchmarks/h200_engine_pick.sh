#!/usr/bin/env bash
# Issue 12 (3, 5) on the H200: engine-wide picks measured by model step
# (fltune/evaluate/engine_pick.py, `fltune adjudicate --engine-choice`). One vLLM engine per
# value of the choice, against vanilla vLLM (its own default, `auto`), arms alternated; the
# pick goes into a copy of the DB ($OUT/engine.db), then freeze, report and the arguments
# `fltune serve` would add (printed, not exec'd).
# Needs vLLM 0.24 staged (PYTHONPATH=/tmp/vsite, ../shared/device/stage-vllm.sh) and .whl
# carried with a fresh fltune wheel (`pip wheel --no-deps -w .whl .`).
#   LIST_ONLY=1 bash benchmarks/h200_engine_pick.sh           # what vLLM offers here, no run
#   CHOICE=attention_backend=FLASHINFER,TRITON_ATTN REPS=5 bash benchmarks/h200_engine_pick.sh
#   CHOICE=gdn_prefill_backend=triton,flashinfer bash benchmarks/h200_engine_pick.sh
# Knobs: CHOICE (attention_backend: every value offered), PROFILE (Qwen3.5-0.8B), DB (the
# shipped H200 DB, copied), REPS (5), WARMUP (1), SCENARIOS (the instrument's five), ENGINE
# (JSON every arm gets), TIMEOUT (540 s: the device's per-command limit is 600).
# FlashInfer JIT-compiles its GDN prefill kernel (and maybe attention kernels) on first use,
# minutes: warm its cache in an earlier command (same machine) before a timed run.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
P=${PROFILE:-Qwen3.5-0.8B}
SRC=${DB:-db/NVIDIA-H200_driver-580.159.04.db}
DB=$OUT/engine.db
cp "$SRC" "$DB" || exit 1
CHOICE=${CHOICE:-attention_backend}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
  python3 -m fltune adjudicate --model "$P" --db "$DB" --engine-choice "${CHOICE%%=*}" \
    --list-values --json | tee "$OUT/listing.json"
  [ -n "$LIST_ONLY" ] && exit 0
  args=()
  [ -n "$SCENARIOS" ] && args+=(--scenarios "$SCENARIOS")
  [ -n "$ENGINE" ] && args+=(--engine "$ENGINE")
  timeout ${TIMEOUT:-540} python3 -m fltune adjudicate --model "$P" --db "$DB" \
    --engine-choice "$CHOICE" --reps "${REPS:-5}" --warmup "${WARMUP:-1}" --out "$OUT/adj" \
    "${args[@]}"
  echo "adjudicate rc=$?"
  python3 -m fltune freeze --db "$DB" --out "$OUT/manifest.json" --json
  python3 -m fltune report --db "$DB" --wide > "$OUT/report.txt"
  sed -n '/engine-wide picks/,$p' "$OUT/report.txt"
  python3 - "$OUT" "$P" <<'EOF'
import sys
from fltune.evaluate.model_dir import model_dir
from fltune.integrations.vllm import serve
out, prof = sys.argv[1], sys.argv[2]
mdir = model_dir(prof, f"{out}/model")
argv, _, plan = serve.prepare(f"{out}/manifest.json", False, ["--model", mdir])
print("fltune serve would exec:", " ".join(argv[2:]))
EOF
} 2>&1 | tee "$OUT/log"
