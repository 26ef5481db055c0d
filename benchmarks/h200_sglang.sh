#!/usr/bin/env bash
# Issue 13, part 2 on the H200: SGLang 0.5.17 (staged by scripts/stage-sglang.sh into
# /tmp/sgstage, installed here into /tmp/sgsite) over vLLM 0.24's stage (/tmp/vsite: the
# server deps, and vLLM's _C kernels, which the shipped DB's vendor.vllm picks are) and the
# fltune wheel from .whl (its sglang.srt.plugins entry point).
#
# 1. freeze the shipped H200 DB (Qwen3-0.6B's ops are in it) into a manifest;
# 2. preflight: SGLang imports, fltune's plugin is discovered through SGLang's own loader;
# 3. serve Qwen3-0.6B's config with dummy weights, arms alternated: off (vanilla SGLang),
#    on (FLTUNE_ROUTE=all: every non-native pick routed), auto (the default route rule),
#    REPS times each (default 1: the whole script must end within a call's 10 minutes); greedy tokens compared, counters printed; then one compiled pair
#    (--enable-torch-compile: routed ops must stay routed inside SGLang's compiled graphs);
# 4. $OUT/arms.json (every arm's JSON, one file: few files come back from $OUT),
#    $OUT/summary.json (tokens equal to off?, tok/s per arm, counters), manifest.json, log.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
if [ ! -d /tmp/sgsite/sglang ]; then
  ( cd /tmp/sgstage \
    && for w in $(ls *.part000 2>/dev/null); do b=${w%.part000}; cat $(ls "$b".part* | sort) > "$b" && rm "$b".part*; done \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgsite ./*.whl ) \
    || { echo "h200_sglang.sh: installing the staged SGLang failed (scripts/stage-sglang.sh)"; exit 1; }
fi
export PYTHONPATH=/tmp/site:/tmp/sgsite:$PWD:/tmp/vsite
export SGLANG_PLUGINS=fltune          # only fltune's general plugin (none other is staged)
PROFILE=${PROFILE:-Qwen3-0.6B}
{
  set -x
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, sglang, sgl_kernel, flashinfer; print('torch', torch.__version__, '| sglang', sglang.__version__, '| sgl_kernel', sgl_kernel.__version__, '| flashinfer', flashinfer.__version__)"
  ARMS=/tmp/sglang-arms; rm -rf "$ARMS"; mkdir -p "$ARMS"
  cp db/NVIDIA-H200_driver-580.159.04.db /tmp/h200-sglang.db
  python3 -m fltune freeze --db /tmp/h200-sglang.db --out "$OUT/manifest.json"
  export FLTUNE_MANIFEST=$(realpath "$OUT/manifest.json") FLTUNE_STRICT=1
  python3 - <<'PY'
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
print("sglang.srt.plugins:", {k: f"{v[0].__module__}.{v[0].__name__}" for k, v in found.items()})
assert "fltune" in found, "fltune's entry point is not visible to SGLang"
PY
  for rep in $(seq 1 "${REPS:-1}"); do
    timeout 420 python3 benchmarks/h200_sglang.py --profile "$PROFILE" --arm off --out "$ARMS"
    FLTUNE_ROUTE=all timeout 420 python3 benchmarks/h200_sglang.py --profile "$PROFILE" --arm on --out "$ARMS"
    FLTUNE_ROUTE=auto timeout 420 python3 benchmarks/h200_sglang.py --profile "$PROFILE" --arm auto --out "$ARMS"
    mkdir -p "$ARMS/rep$rep" && mv "$ARMS"/sglang-*.json "$ARMS/rep$rep/"
  done
  timeout 500 python3 benchmarks/h200_sglang.py --profile "$PROFILE" --arm off-compiled --torch-compile --out "$ARMS" \
    || echo "off-compiled failed"
  FLTUNE_ROUTE=all timeout 500 python3 benchmarks/h200_sglang.py --profile "$PROFILE" --arm on-compiled --torch-compile --out "$ARMS" \
    || echo "on-compiled failed"
  set +x
  python3 - "$ARMS" "$OUT" <<'PY'
import glob, json, os, sys
arms, out = sys.argv[1], sys.argv[2]
docs = {}
for f in sorted(glob.glob(os.path.join(arms, "rep*", "sglang-*.json")) + glob.glob(os.path.join(arms, "sglang-*.json"))):
    d = json.load(open(f))
    docs.setdefault(d["arm"], []).append(d)
json.dump(docs, open(os.path.join(out, "arms.json"), "w"), indent=1)
summary = {"tok_per_s": {arm: [d["output_tok_per_s"] for d in ds] for arm, ds in docs.items()}}
off = docs.get("off", [{}])[0].get("tokens")
summary["tokens_equal_to_off"] = {arm: all(d["tokens"] == off for d in ds) for arm, ds in docs.items() if arm != "off"}
offc = docs.get("off-compiled", [{}])[0].get("tokens")
if offc is not None and "on-compiled" in docs:
    summary["tokens_equal_compiled"] = docs["on-compiled"][0]["tokens"] == offc
summary["counters"] = {arm: [rec.get("counters") for d in ds[:1] for rec in d["counters"].values()] for arm, ds in docs.items()}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
} 2>&1 | tee "$OUT/log"
