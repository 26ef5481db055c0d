#!/usr/bin/env bash
# Issue 14 part 2 on the two-GPU H200 (device kind nvidia-h200-x2): `fltune calibrate --ray` on
# both GPUs (one device key: the work is split) against a one-GPU calibration of the same model
# and ops, with the wall times; then the resume (a rerun measures nothing), `fltune verify --ray`
# (both GPUs' node re-timed) and `fltune diff` of the two DBs (which winners the split changed).
#
# Before: Ray staged by scripts/stage-ray.sh (its last call runs this script), .whl carried with a
# fltune wheel built from this checkout (`pip wheel --no-deps -w .whl .`: it must contain
# fltune/tune/ray_calibrate.py), vLLM optionally staged (PYTHONPATH=/tmp/vsite, see
# ../shared/device/stage-vllm.sh; without it the vendor.vllm and native.vllm candidates do not
# qualify, in both arms alike).
#
# Knobs (environment): MODEL (default Qwen3.5-0.8B), OPS (comma list; default: the model's
# default op set), BUDGET (seconds of timing per candidate, default 0.02 as h200_calibrate.sh),
# MAX_TOKENS (default: the GPU default, 16384), TP (tensor-parallel size of the shapes, default 1:
# `--tp N` calibrates one rank's shapes).
# Each arm has its own Inductor and Triton caches, so neither reuses the other's compiled
# kernels (the second arm would otherwise look faster for having compiled nothing).
# Output under $OUT: one-gpu.db/.json, ray.db/.json, ray-rerun.json, verify-ray.json,
# diff.txt, times.txt, log.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
RAYSITE=/tmp/raysite
if [ ! -d "$RAYSITE/ray" ]; then
  ( cd /tmp/raystage 2>/dev/null \
    && whl=$(cat RAY_WHEEL) \
    && { [ -f "$whl" ] || cat $(ls ray.part* | sort -V) > "$whl"; } \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$RAYSITE" ./*.whl ) \
  || { echo "h200_ray.sh: Ray is not staged: run scripts/stage-ray.sh here and make the calls it prints" >&2; exit 1; }
fi
export PYTHONPATH=$PYTHONPATH:$RAYSITE
python3 -c "import ray, fltune.tune.ray_calibrate; print('ray', ray.__version__)" \
  || { echo "h200_ray.sh: ray or fltune.tune.ray_calibrate does not import (a stale fltune wheel in .whl? rebuild: pip wheel --no-deps -w .whl .)" >&2; exit 1; }

MODEL=${MODEL:-Qwen3.5-0.8B}
BUDGET=${BUDGET:-0.02}
args=(--model "$MODEL" --budget "$BUDGET" --quiet --json)
[ -n "${OPS:-}" ] && args+=(--ops "$OPS")
[ -n "${MAX_TOKENS:-}" ] && args+=(--max-tokens "$MAX_TOKENS")
[ -n "${TP:-}" ] && args+=(--tp "$TP")
rm -f "$OUT"/one-gpu.db* "$OUT"/ray.db*

# wall seconds of a command (the whole process: imports, Ray start, actors), its status kept
timed() { local s e rc; s=$(date +%s.%N); "$@"; rc=$?; e=$(date +%s.%N)
          python3 -c "print(f'{$e - $s:.1f}')" > /tmp/h200_ray_wall; return $rc; }
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm --format=csv
  unset RAY_ADDRESS
  echo "== one GPU: fltune calibrate ${args[*]}"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-one TRITON_CACHE_DIR=/tmp/tri-one CUDA_VISIBLE_DEVICES=0 \
    timed python3 -m fltune calibrate "${args[@]}" --db "$OUT/one-gpu.db" > "$OUT/one-gpu.json"
  echo "one-gpu rc=$? wall $(cat /tmp/h200_ray_wall) s" | tee "$OUT/times.txt"
  echo "== two GPUs: fltune calibrate ${args[*]} --ray"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-ray TRITON_CACHE_DIR=/tmp/tri-ray \
    timed python3 -m fltune calibrate "${args[@]}" --db "$OUT/ray.db" --ray > "$OUT/ray.json"
  echo "ray rc=$? wall $(cat /tmp/h200_ray_wall) s" | tee -a "$OUT/times.txt"
  echo "== resume: the same --ray command again (measures nothing)"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-ray TRITON_CACHE_DIR=/tmp/tri-ray \
    timed python3 -m fltune calibrate "${args[@]}" --db "$OUT/ray.db" --ray > "$OUT/ray-rerun.json"
  echo "ray-rerun rc=$? wall $(cat /tmp/h200_ray_wall) s" | tee -a "$OUT/times.txt"
  echo "== fltune verify --ray"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-ray TRITON_CACHE_DIR=/tmp/tri-ray \
    timed python3 -m fltune verify --db "$OUT/ray.db" --ray --json --out "$OUT/verify-ray.json" > /dev/null
  echo "verify-ray rc=$? wall $(cat /tmp/h200_ray_wall) s" | tee -a "$OUT/times.txt"
  python3 -m fltune diff "$OUT/one-gpu.db" "$OUT/ray.db" --wide > "$OUT/diff.txt"; echo "diff rc=$?"
  tail -5 "$OUT/diff.txt"
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{out}/{name}"))
    except (OSError, ValueError) as e:
        return {"error": str(e)}
one, ray_, again, ver = (load(n) for n in ("one-gpu.json", "ray.json", "ray-rerun.json",
                                           "verify-ray.json"))
walls = {}
for line in open(f"{out}/times.txt"):        # "NAME rc=N wall S s"
    name, _, rest = line.partition(" rc=")
    if "wall " in rest:
        walls[name] = rest.split("wall ")[1].split()[0]
print("summary")
print(f"  one GPU : {one.get('measured')} bands, in-process {one.get('wall_s')} s, process {walls.get('one-gpu')} s")
print(f"  --ray   : {ray_.get('measured')} bands on {len(ray_.get('actors', []))} actors "
      f"({', '.join(str(a['actor']) + ': ' + str(a['bands']) for a in ray_.get('actors', []))}), "
      f"in-process {ray_.get('wall_s')} s, process {walls.get('ray')} s")
for g in ray_.get("groups", []):
    print(f"    {g['device']['name']} [{g['device']['device_key']}]: status {g['status']}, "
          f"spread between the two GPUs over {len(g['spread_samples'])} bands: median "
          f"{g['spread_median']}, max {g['spread_max']}")
print(f"  rerun   : {again.get('measured')} measured, {again.get('skipped')} skipped, process {walls.get('ray-rerun')} s")
print(f"  verify --ray: drifted nodes {ver.get('drifted_nodes')}, {ver.get('checked')} bands, "
      f"uncalibrated {ver.get('uncalibrated_nodes')}")
try:
    print(f"  speedup (process wall, one GPU / --ray): {float(walls['one-gpu']) / float(walls['ray']):.2f}x")
except (KeyError, ValueError, ZeroDivisionError):
    pass
PY
} 2>&1 | tee "$OUT/log"
