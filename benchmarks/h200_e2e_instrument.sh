#!/usr/bin/env bash
# Issue 11 (2, 4) on the H200: the end-to-end instrument (`fltune bench --e2e`,
# fltune/evaluate/e2e.py). One in-process vLLM engine per arm, all alive together, arms
# alternated per repetition; ratio to vanilla with a 95% bootstrap CI, GPU kernel time per
# step from torch.profiler. Writes $OUT/e2e-summary.json, $OUT/e2e-raw.json, worker logs.
# Needs vLLM 0.24 staged (PYTHONPATH=/tmp/vsite, ../shared/device/stage-vllm.sh) and .whl
# carried with a fresh fltune wheel (`pip wheel --no-deps -w .whl .`): each worker loads the
# plugin through vLLM's entry point, and /tmp/site comes first on PYTHONPATH.
#   PROFILE=Qwen3.5-0.8B REPS=10 SCENARIOS=decode_b1,prefill_2048 bash benchmarks/h200_e2e_instrument.sh
# Arms (ARMS, default "aa calibrated fl"): vanilla is always there (vLLM's defaults, no fltune
# variable in its environment) | aa: a second vanilla (A/A: the instrument's noise) |
# calibrated: `fltune serve --db` as users run it (FLTUNE_DB, default route) | fl: the fixed FL
# order (`fltune freeze --order fl`), every op it routes routed (FLTUNE_ROUTE=all).
# Knobs: REPS (10), WARMUP (2), SCENARIOS (all five), PROFILE (Qwen3.5-0.8B), DB, ENGINE (JSON
# over the engine defaults, e.g. '{"additional_config":{"gdn_prefill_backend":"auto"}}'),
# TIMEOUT (seconds, 570: the device's per-command limit is 600).
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
P=${PROFILE:-Qwen3.5-0.8B}
DB=${DB:-db/NVIDIA-H200_driver-580.159.04.db}
ARMS=${ARMS:-"aa calibrated fl"}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
  args=(--arm vanilla=vanilla)
  for a in $ARMS; do
    case $a in
      aa) args+=(--arm aa=vanilla) ;;
      calibrated) args+=(--arm "calibrated=db:$DB") ;;
      fl) python3 -m fltune freeze --db "$DB" --out "$OUT/manifest-fl.json" --order fl || exit 1
          args+=(--arm "fl=manifest:$OUT/manifest-fl.json:all") ;;
      *) echo "unknown arm $a"; exit 2 ;;
    esac
  done
  [ -n "$SCENARIOS" ] && args+=(--scenarios "$SCENARIOS")
  [ -n "$ENGINE" ] && args+=(--engine "$ENGINE")
  timeout ${TIMEOUT:-570} python3 -m fltune bench --e2e --model "$P" --reps "${REPS:-10}" \
    --warmup "${WARMUP:-2}" --out "$OUT" "${args[@]}" $EXTRA
  echo "e2e rc=$?"
} 2>&1 | tee "$OUT/log"
