#!/usr/bin/env bash
# Session 8 on the two-GPU H200 (device kind nvidia-h200-x2): issue 14 on real GPUs.
# vLLM 0.24 staged in /tmp/vsite (../shared/device/stage-vllm.sh), Ray in /tmp/raystage
# (scripts/stage-ray.sh), .whl carried with a fltune wheel built from this commit; one phase
# per device call; state under /tmp/s8 (kept while the machine is warm). Every phase packs
# what it wrote into $OUT/PHASE.tgz (a device call brings back at most 8 files).
#   PHASE=ray      `fltune calibrate --model Qwen3.5-0.8B --tp 2` on one GPU, then the same
#                  with `--ray` on both (one device key: the work split), the rerun (resume),
#                  `fltune verify --ray`, `fltune diff` (benchmarks/h200_ray.sh). The --ray DB
#                  is the TP=2 DB the next phases serve.
#   PHASE=tpserve  `fltune serve --strict --db ray.db -- ... --tensor-parallel-size 2`
#                  (FLTUNE_ROUTE=${ROUTE:-all}) beside plain `vllm serve` at TP=2: the
#                  fingerprint and counters of each rank, greedy tokens against vanilla
#                  (benchmarks/tp_serve.py).
#   PHASE=tpab     the in-context instrument at TP=2 (`fltune bench --e2e`, engine
#                  tensor_parallel_size=2): vanilla, aa (A/A: the noise), all (the DB's race
#                  winners routed), [auto]. Run in session 8 with vLLM's worker profiler for
#                  the kernel profile, which left no trace; the instrument now profiles each
#                  rank through LLM.collective_rpc (PHASE=tpprof).
#   PHASE=tpprof   (not run yet) the kernel profile at TP=2, collectives included: the
#                  instrument with few reps (REPS, default 3) whose aim is the per-rank kernel
#                  table (torch.profiler in each rank through LLM.collective_rpc), arms vanilla
#                  and all; `collectives` / `collective_us_per_step` per point in e2e-raw.json.
#   PHASE=arpick   (not run yet) `fltune adjudicate --engine-choice allreduce_rms_fusion
#                  --engine '{"tensor_parallel_size": 2}'`: vLLM's fused all-reduce + RMSNorm
#                  on (its default here) against off, by model step, into ray.db.
# NVLink multicast stays off (the machine's rule: NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are exported here too, so every
# process started below has them); vLLM's symmetric-memory all-reduce then disables itself
# (no multicast pointer), as it would on any host without NVLS.
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_CACHE_DIR=/tmp/s8/inductor TRITON_CACHE_DIR=/tmp/s8/triton
export VLLM_CACHE_ROOT=/tmp/s8/vllm FLASHINFER_WORKSPACE_BASE=/tmp/s8/fiws
mkdir -p /tmp/s8
P=${PROFILE:-Qwen3.5-0.8B}
DB=/tmp/s8/ray.db
OPS=${OPS:-gemma_rms_norm,gemma_fused_add_rms_norm,mrope,rms_norm_gated,silu_and_mul}
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }
W=/tmp/s8/${PHASE:-ray}; mkdir -p "$W"
pack() { find "$W" -name '*.log' -size +200k -exec gzip -f {} \;
         tar -czf "$OUT/${PHASE:-ray}.tgz" -C "$(dirname "$W")" "$(basename "$W")"; }
leftovers() { pkill -f 'vllm.entrypoints|fltune serve|e2e_worker|ray::' 2>/dev/null; sleep 2; }
tp_db() {      # the TP=2 DB: the --ray phase's, or (that phase failed) one GPU's
  [ -f $DB ] && return
  el "no $DB: fltune calibrate --tp 2 on one GPU"
  CUDA_VISIBLE_DEVICES=0 python3 -m fltune calibrate --model "$P" --tp 2 --ops "$OPS" \
    --budget 0.02 --db $DB --quiet --json > "$W/calibrate-fallback.json"; echo "calibrate rc=$?"
}
case ${PHASE:-ray} in
ray) {
  nvidia-smi topo -m; env | grep -E 'NVLS|MULTICAST' | sort
  el "h200_ray.sh TP=2"
  OUT=$W MODEL=$P TP=2 OPS=$OPS timeout ${TIMEOUT:-540} bash benchmarks/h200_ray.sh; echo "h200_ray rc=$?"
  cp "$W/ray.db" $DB 2>/dev/null
  el done
} 2>&1 | tee "$W/s8.log"; pack ;;
tpserve) {
  leftovers; tp_db
  el "tp_serve: fltune serve --db $DB (route ${ROUTE:-all}) beside vanilla, TP=2"
  timeout ${TIMEOUT:-560} python3 benchmarks/tp_serve.py --db $DB --profile "$P" --tp 2 \
    --route "${ROUTE:-all}" --out "$W" --start-timeout ${START_TIMEOUT:-480}; echo "tp_serve rc=$?"
  leftovers; el done
} 2>&1 | tee "$W/s8.log"; cp "$W/tp-$P.json" "$OUT/" 2>/dev/null; pack ;;
tpab) {
  leftovers; tp_db
  arms=(--arm vanilla=vanilla --arm aa=vanilla --arm all=db:$DB:all)
  [ -n "${AUTO:-}" ] && arms+=(--arm auto=db:$DB)
  el "bench --e2e TP=2: ${arms[*]}"
  timeout ${TIMEOUT:-560} python3 -m fltune bench --e2e --model "$P" \
    --engine '{"tensor_parallel_size": 2}' "${arms[@]}" --reps ${REPS:-10} \
    ${SCENARIOS:+--scenarios "$SCENARIOS"} --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  leftovers; el done
} 2>&1 | tee "$W/s8.log"; cp "$W/e2e-summary.json" "$OUT/" 2>/dev/null; pack ;;
tpprof) {
  leftovers; tp_db
  el "bench --e2e TP=2 for the kernel profile"
  timeout ${TIMEOUT:-560} python3 -m fltune bench --e2e --model "$P" \
    --engine '{"tensor_parallel_size": 2}' --arm vanilla=vanilla --arm all=db:$DB:all \
    --reps ${REPS:-3} --scenarios "${SCENARIOS:-decode_b1,decode_b64,prefill_2048}" \
    --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  python3 - "$W/e2e-raw.json" <<'PY'
import json, sys
try:
    raw = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no raw result: {e}")
for scn, arms in (raw.get("kernels") or {}).items():
    for arm, k in arms.items():
        print(f"{scn:14s} {arm:8s} kernel/step {k.get('kernel_us_per_step')} us, "
              f"collectives {k.get('collective_us_per_step')} us, ranks "
              f"{k.get('rank_kernel_us_per_step')} {k.get('error', '')}")
        for c in (k.get("collectives") or [])[:4]:
            print(f"    {c['us_per_step']:9.2f} us  {c['calls_per_step']:6.1f}/step  {c['name'][:90]}")
PY
  leftovers; el done
} 2>&1 | tee "$W/s8.log"; pack ;;
arpick) {
  leftovers; tp_db
  el "adjudicate --engine-choice allreduce_rms_fusion at TP=2"
  timeout ${TIMEOUT:-560} python3 -m fltune adjudicate --db $DB --model "$P" \
    --engine-choice allreduce_rms_fusion --engine '{"tensor_parallel_size": 2}' \
    --reps ${REPS:-8} --scenarios "${SCENARIOS:-decode_b1,decode_b64,prefill_2048}" \
    --out "$W/adjudicate" --json > "$W/adjudicate.json"; echo "adjudicate rc=$?"
  python3 -m fltune report --db $DB --wide 2>&1 | sed -n '/engine/,$p' | head -20
  cp $DB "$W/"; leftovers; el done
} 2>&1 | tee "$W/s8.log"; pack ;;
esac
