#!/usr/bin/env bash
# Issue 5 on the H200: bench (manifest vs FL vs each backend vs oracle), verify, dispatch overhead.
# vLLM staged (PYTHONPATH=/tmp/vsite) and .whl carried, as in h200_serve.sh.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
DB=db/NVIDIA-H200_driver-580.159.04.db
{
  python3 -m fltune bench --model Qwen3.5-0.8B --db $DB --quiet --out $OUT/bench-qwen3.5-0.8b.json > $OUT/bench-qwen3.5-0.8b.txt; echo "bench rc=$?"
  python3 -m fltune verify --db $DB --quiet --out $OUT/verify.json > $OUT/verify.txt; echo "verify rc=$?"
  python3 benchmarks/dispatch_overhead.py --out $OUT/dispatch_overhead-cuda.json
} 2>&1 | tee "$OUT/log"
