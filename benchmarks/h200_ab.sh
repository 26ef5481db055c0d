#!/usr/bin/env bash
# End-to-end A/B on the H200: the same model config, vanilla vLLM then vLLM with the
# calibrated manifest, in one call (vLLM staged, .whl carried; see h200_serve.sh).
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
P=${PROFILE:-Qwen3.5-0.8B}
{
  python3 -m fltune freeze --db db/NVIDIA-H200_driver-580.159.04.db --out "$OUT/manifest.json"
  export FLTUNE_MANIFEST=$(realpath "$OUT/manifest.json")
  timeout 280 python3 benchmarks/h200_serve.py --profile "$P" --out "$OUT" --batch ${BATCH:-16} --no-plugin
  timeout 280 python3 benchmarks/h200_serve.py --profile "$P" --out "$OUT" --batch ${BATCH:-16}
} 2>&1 | tee "$OUT/log"
