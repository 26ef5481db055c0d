#!/usr/bin/env bash
# The H200 evidence run (device tool; see ../shared/device/README.md). Carry .whl.
#   run: bash calibrate/recipes/h200_calibrate.sh   (with vLLM staged: PYTHONPATH=/tmp/vsite, see ../shared/device/stage-vllm.sh)
# Writes under $OUT: candidates.json, gpu_parity.json, the calibration DB (cold + warm run
# times), the manifest and the report (text + JSON), and the log.
source "$(dirname "$0")/device_env.sh"
DRV=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
DB="$OUT/NVIDIA-H200_driver-${DRV}.db"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -m fltune candidates --json > "$OUT/candidates.json" && echo "candidates ok"
  python3 benchmarks/parity_sweep.py --model Qwen3.5-0.8B --dtypes bf16,fp16 --tokens 1,64,4096 --out "$OUT/gpu_parity.json"
  s=$(date +%s.%N); python3 -m fltune calibrate --model Qwen3.5-0.8B --db "$DB" --budget 0.02 --quiet --json > "$OUT/calibrate_cold.json"; e=$(date +%s.%N)
  echo "cold calibration wall: $(python3 -c "print(round($e-$s,1))") s (process, incl. imports)"
  s=$(date +%s.%N); python3 -m fltune calibrate --model Qwen3.5-0.8B --db "$DB" --quiet --json > "$OUT/calibrate_warm.json"; e=$(date +%s.%N)
  echo "warm rerun wall: $(python3 -c "print(round($e-$s,1))") s (process, incl. imports)"
  python3 -m fltune freeze --db "$DB" --out "$OUT/manifest-qwen3.5-0.8b.json"
  python3 -m fltune report --db "$DB" > "$OUT/report.txt"; cat "$OUT/report.txt"
  python3 -m fltune report --db "$DB" --json > "$OUT/report.json"
} 2>&1 | tee "$OUT/log"
