#!/usr/bin/env bash
# Issue 5, item 2 on the H200: crossover refinement of Qwen3.5-0.8B's tables, in a copy of the
# shipped DB (the file in db/ is never written). Needs the same setup as h200_calibrate.sh:
# vLLM 0.24 staged (PYTHONPATH=/tmp/vsite, see ../shared/device/stage-vllm.sh) and .whl carried.
# Without it the software stack differs from the one the DB was measured with, every pair of
# bands would be skipped, and the preflight below stops at once instead.
# Budget: about 25 probes of two candidates (< 3 min); refine is capped by `timeout 150`, and a
# killed run keeps every pair it finished (one transaction each).
# Writes under $OUT: the refined DB copy, refine-qwen3.5-0.8b.{json,txt}, the refined manifest,
# the log.
source "$(dirname "$0")/device_env.sh"
# `fltune refine` is newer than the fltune wheel in .whl, which device_env.sh puts first: the
# source tree goes before it (the same version string, so the same stack key).
export PYTHONPATH=$PWD:$PYTHONPATH
DB="$OUT/NVIDIA-H200_driver-580.159.04.db"
cp db/NVIDIA-H200_driver-580.159.04.db "$DB"
{
  if ! python3 - "$DB" <<'PY'
import sqlite3, sys
from fltune.store import device as d
now = d.stack_key(d.stack())
con = sqlite3.connect(sys.argv[1])
have = {k for (k,) in con.execute("select distinct stack_key from winners")}
print(f"stack now {now} {d.stack()}; DB winners measured with {sorted(have)}")
sys.exit(0 if now in have else 1)
PY
  then
    echo "stack differs from the DB's: stage vLLM 0.24 and carry .whl (see the header); not refining"
    exit 3
  fi
  s=$(date +%s.%N)
  timeout 150 python3 -m fltune refine --db "$DB" --model Qwen3.5-0.8B --quiet \
    --out "$OUT/refine-qwen3.5-0.8b.json" > "$OUT/refine-qwen3.5-0.8b.txt"; echo "refine rc=$?"
  e=$(date +%s.%N); echo "refine wall: $(python3 -c "print(round($e-$s,1))") s (process, incl. imports)"
  cat "$OUT/refine-qwen3.5-0.8b.txt"
  python3 -m fltune freeze --db "$DB" --out "$OUT/manifest-refined.json"; echo "freeze rc=$?"
  python3 - "$OUT/manifest-refined.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
for op, e in sorted(m["ops"].items()):
    for t in e["tables"]:
        for b in t["bands"]:
            if b.get("refined"):
                print(f"refined edge: {op} [{t['signature']}] {b['impl_id']} up to {b['hi']} "
                      f"tokens (was {b['coarse_hi']}), {len(b['crossover_probes'])} probes")
PY
} 2>&1 | tee "$OUT/log"
