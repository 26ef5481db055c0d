#!/usr/bin/env bash
# Issue 4 on the H200: vLLM 0.24 (staged: PYTHONPATH=/tmp/vsite, see ../shared/device/stage-vllm.sh)
# + fltune installed as a wheel (so vLLM finds the vllm.general_plugins entry point) from .whl.
# Calibrates Qwen3-0.6B into a copy of the shipped H200 DB (Qwen3.5 is already in it), freezes,
# then serves Qwen3.5-0.8B and Qwen3-0.6B configs with dummy weights through the plugin.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
DB="$OUT/NVIDIA-H200_driver-580.159.04.db"
cp db/NVIDIA-H200_driver-580.159.04.db "$DB"
{
  python3 -m fltune calibrate --model Qwen3-0.6B --db "$DB" --budget 0.02 --quiet --json > "$OUT/calibrate_qwen3.json"
  python3 -m fltune freeze --db "$DB" --out "$OUT/manifest.json"
  python3 -m fltune report --db "$DB" --op rms_norm > "$OUT/report_rms_norm.txt"
  export FLTUNE_MANIFEST=$(realpath "$OUT/manifest.json")
  for p in ${PROFILES:-Qwen3-0.6B Qwen3.5-0.8B}; do
    timeout 420 python3 benchmarks/h200_serve.py --profile "$p" --out "$OUT"
  done
} 2>&1 | tee "$OUT/log"
