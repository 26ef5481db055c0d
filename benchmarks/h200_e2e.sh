#!/usr/bin/env bash
# Issue 4 + 5 on the H200: `fltune serve` as real OpenAI servers, end-to-end A/B against
# vanilla vLLM, all arms alive at once and measured interleaved (benchmarks/e2e_ab.py).
# Needs vLLM 0.24 staged (PYTHONPATH=/tmp/vsite, ../shared/device/stage-vllm.sh) and .whl
# carried with a fresh fltune wheel (`pip wheel --no-deps -w .whl .`: vLLM finds the plugin
# through its entry point).
#   PROFILE=Qwen3-0.6B bash benchmarks/h200_e2e.sh
# Arms: vanilla (vLLM's default compile, custom ops off, no fltune) | fl: the fixed FL order
# (`fltune freeze --order fl`), every op routed | all: the calibrated manifest, every op it
# picks routed | auto: `fltune serve --db` with the default FLTUNE_ROUTE=auto (ops kept native
# where their decode win does not pay for the fusion they would lose).
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
P=${PROFILE:-Qwen3-0.6B}
DB=db/NVIDIA-H200_driver-580.159.04.db
ARMS=${ARMS:-"vanilla fl all auto"}
{
  python3 -m fltune freeze --db $DB --out "$OUT/manifest-measured.json" || exit 1
  python3 -m fltune freeze --db $DB --out "$OUT/manifest-fl.json" --order fl || exit 1
  args=()
  for a in $ARMS; do
    case $a in
      vanilla) args+=(--arm vanilla) ;;
      fl) args+=(--arm "fl=$OUT/manifest-fl.json:all") ;;
      all) args+=(--arm "all=$OUT/manifest-measured.json:all") ;;
      auto) args+=(--arm "auto=$DB:auto") ;;
    esac
  done
  timeout ${TIMEOUT:-560} python3 benchmarks/e2e_ab.py --profile "$P" --out "$OUT" "${args[@]}" $EXTRA
  echo "e2e rc=$?"
} 2>&1 | tee "$OUT/log"
