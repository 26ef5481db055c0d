#!/usr/bin/env bash
# The one-H200 sessions' script (7, 9, 10): issue 13 (the vLLM IR route, the SGLang bridge),
# then issues 11 and 12 (linear per range, FlashInfer's JIT, the GDN pick, the wall A/A).
# Order on a fresh machine: stage vLLM, then gdnpick (vLLM's true GDN default, with the
# prebuilt FlashInfer modules of benchmarks/flashinfer-aot/ restored below: no JIT; if they
# fail to load there, PHASE=fibuild builds them on the machine, ~10 min), then pinaa; every
# instrument run ends inside its phase's timeout (FLTUNE_E2E_TIME_LIMIT from `lim` below).
# A fresh machine's first engine also autotunes the FLA kernels (~90 s): a carried
# .fiaot/triton.tgz (Triton's cache from an earlier machine) saves that.
# vLLM 0.24 staged in /tmp/vsite (scripts/stage-vllm.sh prints the calls; the last one carries
# .veN, .whl and the vllm-install.sh it writes: `bash vllm-install.sh && PHASE=... bash
# benchmarks/h200_s7.sh`), SGLang 0.5.17 in /tmp/sgstage (scripts/stage-sglang.sh),
# .whl carried with a fresh fltune wheel; one phase per device call; state under /tmp/s7
# (kept while the machine is warm). Every phase packs what it wrote into $OUT/PHASE.tgz
# (a device call brings back at most 8 files).
#   PHASE=irchk  one engine per model through FLTUNE_SEAM=ir (benchmarks/ir_check.py):
#                vLLM's priority list and IR state, counters, greedy tokens against plugin-off.
#                Qwen3-0.6B with ROUTE=ops:fused_add_rms_norm,rms_norm and compile ranges at
#                the manifest's native/other edges; Qwen3.5-0.8B with the default route.
#   PHASE=ir     the in-context instrument with the IR route as an arm (benchmarks/ir_e2e.py)
#                for PROFILE (Qwen3-0.6B: ARMS vanilla,aa,ir; ENDPOINTS=auto).
#   PHASE=sgab   SGLang with the in-context method (benchmarks/sglang_ab.py): vanilla, A/A,
#                fltune's default route, alternated, REPS repetitions.
#   PHASE=sgc    SGLang --enable-torch-compile, plugin off vs FLTUNE_ROUTE=all
#                (benchmarks/h200_sglang.py): tokens and counters inside compiled graphs.
#   PHASE=linrange  issue 11.3 + 12: `linear` decided per token range on
#                Qwen3.5-0.8B from session 6's calibrated DB (band-1 max-autotune wins: GPU
#                1.277x per b1 decode step; whole-range decision was native because prefill
#                lost 0.768x wall and the LM head cost ~100 µs per step, since removed from
#                the seam): `fltune adjudicate --ops linear --per-range` (decode <= 512 vs
#                prefill). PROFILE defaults to Qwen3.5-0.8B here.
#   PHASE=linbench  (WARMONLY=1 first on a cold machine: it compiles the arms, nothing measured)
#                the served DB (shipped_db: every decision so far) against vanilla with
#                the instrument (`fltune bench --e2e`, arms vanilla / aa / calibrated, FL=1
#                adds the fixed FL order, FLONLY=1 it alone beside vanilla / aa, HOSTPROF=1 each arm's host time per Python
#                function beyond vanilla's; PROCS=K: `--procs K`, every arm in K processes
#                (the CI resamples them: an offset of one process is noise, not an effect);
#                NOCAL=1: no calibrated arm, e.g. `NOCAL=1 PROCS=3` measures processes' spread;
#                RELABEL=1 on a card other than the DB's: the H200 picks re-labelled, a
#                diagnostic): issue 11's e2e-summary.json for PROFILE (run in
#                session 9 on Qwen3.5's linear decision alone, in session 15 on the shipped DB).
#   PHASE=fijit  (run in session 10; its GDN build outlasted the call: PHASE=fibuild) FlashInfer's JIT (GDN prefill) built once and checked, the
#                built modules split into $OUT/fiaot.tgz.part* (keep them in .fiaot/, carry
#                it: this script unpacks them into FlashInfer's AOT directory first).
#   PHASE=fibuild  FlashInfer's GDN prefill module alone (MAX_JOBS=16), packed like fijit's:
#                run it first on a fresh machine, before anything uses vLLM's default GDN.
#   PHASE=gdnpick  vLLM's GDN prefill kernel picked by model step (`fltune adjudicate
#                --engine-choice gdn_prefill_backend=triton,flashinfer`) against vanilla `auto`;
#                CHOICE=cudagraph_max_size=2048,8192 the largest CUDA-graph capture size instead
#                (judged by wall time; FLTUNE_E2E_PROCS=K processes per arm, COMPILE_AA=off
#                leaves out the compile A/A arm's compiles);
#                PHASE=fijit also races the GDN ops (calibrate) into lin.db after the build.
#   PHASE=q06    Qwen3-0.6B's `linear` calibrated into the shipped DB's copy (/tmp/s7/lin.db),
#                then adjudicated per token range with the call's remaining time
#   PHASE=coldlin PROFILE's `linear` decode bands re-raced with --cold-weights (session 20)
#                into the shipped DB's copy, `fltune diff` before/after; ADJ=1 then adjudicates
#                per range with the call's remaining time (EDGES, SCENARIOS)
#   PHASE=native native.vllm against the model's own kernels (benchmarks/native_in_model.py);
#                SKIPMODEL=1: the candidate alone (its warm, params-cold and in-context profiles, ~100 s),
#                to join with an earlier run's in-model part (--analyse); IMPLS=native.vllm,
#                vendor.flashinfer,default.flagos,vendor.vllm profiles those in context too (ranking)
#   PHASE=draw   Inductor's first-call autotune of OP drawn DRAWS times (benchmarks/autotune_draw.py)
#   PHASE=opsadj the ops whose picks fiops changed, decided by model step (both models)
#   PHASE=fiops  FlashInfer's norm/activation/rope candidates raced (calibrate --force) for
#                both models' ops into the shipped DB's copy
#   PHASE=state  the wall A/A against the engines' compile state (session 27): vanilla, aa,
#                caa=recompiled, first=first-start; START_STATE (default loaded) restarts the
#                compiled ones but first
#   PHASE=pinaa  (session 10: spent in the GDN JIT, nothing measured) issue 11: a vanilla A/A/A with `--pinning measure` (PINNING=
#                shared for the side-by-side); PINNING also reaches sgab and linbench. Then
#                benchmarks/probe_check.py: do the runs' host-speed probes see the slow periods?
source "$(dirname "$0")/../calibrate/recipes/device_env.sh"
export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_CACHE_DIR=/tmp/s7/inductor TRITON_CACHE_DIR=/tmp/s7/triton
export VLLM_CACHE_ROOT=/tmp/s7/vllm FLASHINFER_WORKSPACE_BASE=/tmp/s7/fiws FLTUNE_MODEL_CACHE=/tmp/s7/models
mkdir -p /tmp/s7
# every instrument run (bench --e2e, adjudicate) ends inside its phase's timeout with what it
# measured, fewer repetitions if need be, instead of being killed at it (run_e2e
# time_limit_s): `lim DEFAULT` = that phase's TIMEOUT (or its default) less 30 s
lim() { local t=${TIMEOUT:-$1}; echo $(( t > 60 ? t - 30 : 0 )); }
# FlashInfer kernels built elsewhere (PHASE=fibuild/fijit brought them back, or
# scripts/build-flashinfer-aot.sh cross-compiled them on a CPU machine; kept in the ignored
# folder .fiaot/, carried, or copied to /tmp/fiaot by an earlier call of this machine; else
# the copy in the repository, benchmarks/flashinfer-aot/, whose README says what each is):
# unpacked into FlashInfer's AOT directory, where JitSpec.build_and_load loads a module's .so
# without building (is_aot), so vLLM's default GDN prefill (FlashInfer on SM90) and its
# FlashInfer sampler start in seconds instead of minutes of JIT (session 11: the sampler's
# JIT alone took 130 s of the first engine's start). A triton.tgz beside them (Triton's cache
# from an earlier machine: the FLA kernels' autotuning, 90 s of that start) goes to
# TRITON_CACHE_DIR.
# every source is unpacked, the preferred last (a module in .fiaot/ replaces the repository's)
if [ ! -f /tmp/s7/aot-restored ]; then
  AOT=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)" 2>/dev/null)
  for FA in benchmarks/flashinfer-aot /tmp/fiaot .fiaot; do
    if [ -n "$AOT" ] && ls "$FA"/fiaot.tgz.part* >/dev/null 2>&1; then
      mkdir -p "$AOT" && cat $(ls "$FA"/fiaot.tgz.part* | sort) | tar -xz -C "$AOT" \
        && touch /tmp/s7/aot-restored && echo "FlashInfer AOT modules from $FA into $AOT"
    fi
    # more modules packed on their own (session 12's norm/activation/rope JIT: ops-fiaot.tgz)
    for f in $(ls "$FA"/*-fiaot.tgz 2>/dev/null); do
      [ -n "$AOT" ] && mkdir -p "$AOT" && tar -xzf "$f" -C "$AOT" \
        && touch /tmp/s7/aot-restored && echo "FlashInfer AOT modules from $f"
    done
  done
  [ -f /tmp/s7/aot-restored ] && echo "FlashInfer AOT modules now: $(cd "$AOT" && ls */*.so | tr '\n' ' ')"
fi
# triton.tgz holds a top-level triton/ folder: `tar -czf triton.tgz -C /tmp/s7 triton` on a
# warm machine (session 11 brought one back so), restored only onto an empty cache
for FA in /tmp/fiaot .fiaot; do
  if [ -f "$FA/triton.tgz" ] && [ ! -d /tmp/s7/triton ]; then
    tar -xzf "$FA/triton.tgz" -C /tmp/s7 triton && echo "Triton cache restored: $(ls /tmp/s7/triton | wc -l) entries"
  fi
done
P=${PROFILE:-$(case "${PHASE:-}" in lin*|pinaa|gdn*|fibuild) echo Qwen3.5-0.8B;; *) echo Qwen3-0.6B;; esac)}
M=/tmp/s7/manifest.json
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }
# the ir*/sglang phases' manifest, frozen from DBSRC where given (on an H100 the shipped H200
# DB holds nothing for the card: until session 44 every phase opened with freeze's error)
[ -f $M ] || python3 -m fltune freeze --db "${DBSRC:-db/NVIDIA-H200_driver-580.159.04.db}" --out $M
# TAG=NAME keeps two calls of one phase and model apart (their own folder and archive)
W=/tmp/s7/${PHASE:-irchk}-$P${PINNING:+-$PINNING}${TAG:+-$TAG}; mkdir -p "$W"
# (the cache sizes say whether carrying warm caches to a later machine would pay)
# (a phase's archive over 15 MiB comes back in parts, $OUT/<phase>.tgz.partN, join with
# `cat <phase>.tgz.part* > <phase>.tgz`: the device tool leaves out any file over its limit,
# which lost session 20's Qwen3.5 PHASE=native archive, 18 MB of Inductor code)
pack() { tar -czf "$OUT/$(basename "$W").tgz" -C "$(dirname "$W")" "$(basename "$W")"
         if [ "$(stat -c %s "$OUT/$(basename "$W").tgz")" -gt $((15 * 1024 * 1024)) ]; then
           split -b 15M -d -a 1 "$OUT/$(basename "$W").tgz" "$OUT/$(basename "$W").tgz.part" \
             && rm "$OUT/$(basename "$W").tgz"; fi
         du -sh /tmp/s7/inductor /tmp/s7/triton /tmp/s7/vllm /tmp/s7/fiws 2>/dev/null | tr '\n' ' '; echo; }
# FlashInfer's built modules (every cached_ops/*/*.so) split into $OUT/fiaot.tgz.part*
# (<= 15 MiB each) for .fiaot/, which the restore above unpacks on a later machine
pack_fi() {
  J=$(ls -d /tmp/s7/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
  echo "JIT dir: $J"; ls -la "$J" 2>/dev/null | head -30
  if [ -n "$J" ]; then
    ( cd "$J" && ls */*.so > "$W/modules.txt" && tar -czf /tmp/s7/fiaot.tgz -T "$W/modules.txt" ) \
      && ls -la /tmp/s7/fiaot.tgz && cat "$W/modules.txt" \
      && split -b 15M -d -a 1 /tmp/s7/fiaot.tgz "$OUT/fiaot.tgz.part"
  fi
}
# the phases' common DB: /tmp/s7/lin.db, a copy of the shipped DB until a phase writes to it
# (session 12 on; kept while the machine is warm, so phases build on each other)
# DBSRC=PATH (a DB file in the checkout) starts from that DB instead, in a copy of its own
# (e.g. session 14's, with Qwen3-0.6B's split GEMMs: `git show aebb8be:db/NVIDIA-H200_driver-580.159.04.db > s14.db`)
shipped_db() {
  # (kept while the machine is warm, as lin.db is: a later phase reads what an earlier
  # one stored, session 37's engine pick then the served DB; DBFRESH=1 copies it anew)
  if [ -n "${DBSRC:-}" ]; then DB=/tmp/s7/alt-$(basename "$DBSRC")
    { [ -f $DB ] && [ "${DBFRESH:-0}" != 1 ]; } || cp "$DBSRC" $DB
  else DB=/tmp/s7/lin.db; [ -f $DB ] || cp db/NVIDIA-H200_driver-580.159.04.db $DB; fi; }
# seconds left of the call (CALL_S, default 570) since the phase began (t0)
call_left() { echo $(( ${CALL_S:-570} - $(date +%s) + t0 )); }
# `linear` decided per token range on $DB: LIMIT (the instrument's), TIMEOUT, REPS
# (decode_b64 in the default since session 19: a 1-512 route judged at 1 and 16 tokens lost
# 2 % kernel time at 64, model_step.coverage_gaps; EDGES=32,512 splits finer)
adjudicate_linear_per_range() {
  FLTUNE_E2E_TIME_LIMIT=$1 timeout $2 python3 -m fltune adjudicate --db $DB --model "$P" \
    --ops linear --per-range ${EDGES:-512} --reps $3 --warmup 1 \
    --scenarios "${SCENARIOS:-decode_b1,decode_b16,decode_b64,prefill_2048}" \
    --out "$W/adjudicate" --json > "$W/adjudicate.json"; echo "adjudicate rc=$?"
}
# the DB's decisions shown, the DB kept beside the phase's files, big logs zipped
keep_decisions() {
  python3 -m fltune report --db $DB --wide 2>&1 | sed -n '/decision/,$p' | head -30
  cp $DB "$W/"
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  rm -rf "$W"/*/model
}
# an instrument run's compile state per arm (session 27: start_state) and its points
state_summary() {
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('start_state', json.dumps(d['host'].get('start_state')))
for n, a in d['arms'].items():
    print(n, 'compile', (a.get('compile') or {}).get('state'), 'first', ((a.get('first_start') or {}).get('compile') or {}).get('state'),
          'start_s', a.get('start_s'), 'first_start_s', (a.get('first_start') or {}).get('start_s'))
for p in d['points']:
    print(p['scenario'], p['arm'], 'n', p['n'], 'wall', round(p['ratio_median'], 3), [round(p['ci_low'], 3), round(p['ci_high'], 3)],
          'kernel', p.get('kernel_ratio_median') and round(p['kernel_ratio_median'], 4), p.get('kernel_ci_low') and [round(p['kernel_ci_low'], 4), round(p['kernel_ci_high'], 4)])
print('notes', d.get('engine_notes'))" "$1"
  # session 40's first profile round (during the warm-up): does it read like the later ones?
  python3 benchmarks/profile_round_check.py "$1" --json "$(dirname "$1")/profile-rounds.json" || true
}
sgl_install() {
  if [ ! -d /tmp/sgsite/sglang ]; then
    ( cd /tmp/sgstage \
      && for w in $(ls *.part000 2>/dev/null); do b=${w%.part000}; cat $(ls "$b".part* | sort) > "$b" && rm "$b".part*; done \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgsite ./*.whl ) \
      || { echo "installing the staged SGLang failed (scripts/stage-sglang.sh)"; exit 1; }
  fi
  export PYTHONPATH=/tmp/site:/tmp/sgsite:$PWD:/tmp/vsite SGLANG_PLUGINS=fltune
}
case ${PHASE:-irchk} in
irchk) {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  EDGES=$(python3 - $M <<'PY'
import json, sys
from fltune.dispatch.manifest import Manifest
from fltune.integrations.vllm.ir_provider import native_edges
print(json.dumps(native_edges(Manifest.from_json(json.load(open(sys.argv[1])), sys.argv[1]))))
PY
)
  echo "edges $EDGES"
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  el "Qwen3-0.6B plugin off"
  timeout 160 python3 benchmarks/ir_check.py Qwen3-0.6B "$W/qwen3-off.json" "$EDGES" > "$W/qwen3-off.log" 2>&1; echo rc=$?
  el "Qwen3-0.6B IR"
  FLTUNE_MANIFEST=$M FLTUNE_SEAM=ir FLTUNE_STRICT=1 FLTUNE_ROUTE=ops:fused_add_rms_norm,rms_norm \
    timeout 200 python3 benchmarks/ir_check.py Qwen3-0.6B "$W/qwen3-ir.json" "$EDGES" > "$W/qwen3-ir.log" 2>&1; echo rc=$?
  tail -40 "$W/qwen3-ir.log" | grep -v "^\s*$" | tail -30
  el "Qwen3.5 IR (default route)"
  FLTUNE_MANIFEST=$M FLTUNE_SEAM=ir FLTUNE_STRICT=1 \
    timeout 170 python3 benchmarks/ir_check.py Qwen3.5-0.8B "$W/qwen35-ir.json" > "$W/qwen35-ir.log" 2>&1; echo rc=$?
  tail -12 "$W/qwen35-ir.log"
  python3 - "$W" <<'PY'
import json, os, sys
w = sys.argv[1]
d = {f: json.load(open(os.path.join(w, f))) for f in os.listdir(w) if f.endswith(".json")}
if "qwen3-off.json" in d and "qwen3-ir.json" in d:
    print("Qwen3-0.6B IR tokens equal plugin-off:", d["qwen3-ir.json"]["tokens"] == d["qwen3-off.json"]["tokens"])
PY
  el done
} 2>&1 | tee "$W/log"; pack ;;
ir) {
  el "ir_e2e $P"
  ARMS=${ARMS:-vanilla,aa,ir} ENDPOINTS=${ENDPOINTS:-auto} REPS=${REPS:-8} \
    FLTUNE_E2E_TIME_LIMIT=$(lim 560) timeout ${TIMEOUT:-560} python3 benchmarks/ir_e2e.py "$P" $M "$W"; echo rc=$?
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$W/log"; cp "$W/e2e-summary.json" "$OUT/e2e-summary-$P.json" 2>/dev/null; pack ;;
sgab) {
  sgl_install
  python3 -c "import torch, sglang, sgl_kernel; print('torch', torch.__version__, '| sglang', sglang.__version__, '| sgl_kernel', sgl_kernel.__version__)"
  el "sglang A/B $P"
  FLTUNE_MANIFEST=$M FLTUNE_STRICT=1 timeout ${TIMEOUT:-540} python3 benchmarks/sglang_ab.py \
    --profile "$P" --reps ${REPS:-10} --warmup 2 --arm off=off --arm aa=off --arm auto=auto \
    --pinning ${PINNING:-shared} ${SGARMS:-} --out "$W"; echo rc=$?
  el done
} 2>&1 | tee "$W/log"; cp "$W/sglang-ab.json" "$OUT/" 2>/dev/null; pack ;;
sgc) {
  sgl_install
  export FLTUNE_MANIFEST=$M FLTUNE_STRICT=1
  el "sglang compiled, off"
  timeout 260 python3 benchmarks/h200_sglang.py --profile "$P" --arm off-compiled --torch-compile --reps 3 --out "$W" \
    || echo "off-compiled failed"
  el "sglang compiled, all routed"
  FLTUNE_ROUTE=all timeout 260 python3 benchmarks/h200_sglang.py --profile "$P" --arm on-compiled --torch-compile --reps 3 --out "$W" \
    || echo "on-compiled failed"
  python3 - "$W" <<'PY'
import glob, json, os, sys
d = {json.load(open(f))["arm"]: json.load(open(f)) for f in glob.glob(os.path.join(sys.argv[1], "sglang-*.json"))}
if "off-compiled" in d and "on-compiled" in d:
    print("tokens equal (compiled):", d["on-compiled"]["tokens"] == d["off-compiled"]["tokens"])
    for k, v in d.items():
        print(k, "tok/s", v["output_tok_per_s"], "init_s", v["init_s"])
PY
  el done
} 2>&1 | tee "$W/log"; pack ;;
state) {
  # session 27: the wall A/A against the engines' compile state. Four vanilla engines of one
  # model: vanilla and aa share one compile cache (vanilla compiles it on a fresh machine, aa
  # loads it), caa (recompiled) and first (first-start) each compile into fresh caches of their
  # own; with the default start_state=loaded vanilla and caa are started again and load what
  # they compiled, first is kept as it compiled. If a compiled engine runs a host-bound
  # prefill slower than a loaded one (sessions 7-18's A/A: aa faster than a compiled vanilla
  # in 9 of 10 runs), first reads below 1 at prefill 2048 and aa and caa read 1.
  el "compile-state A/A (start_state ${START_STATE:-loaded})"
  FLTUNE_E2E_TIME_LIMIT=$(lim 560) timeout ${TIMEOUT:-560} python3 -m fltune bench --e2e --model "$P" \
    --arm vanilla=vanilla --arm aa=vanilla --arm caa=recompiled --arm first=first-start \
    --reps ${REPS:-12} --warmup ${WARMUP:-1} --start-state ${START_STATE:-loaded} \
    --scenarios "${SCENARIOS:-decode_b1,prefill_2048}" --pinning ${PINNING:-shared} \
    --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  state_summary "$W/e2e-raw.json"
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$W/log"; pack ;;
pinaa) {
  # issue 11: does moving the measured arm onto the fastest few cores (and parking the rest)
  # close the wall-time A/A? Same arms and scenarios as linbench's noise arms, PINNING=measure
  # (or shared, for the side-by-side); three vanilla engines, so the A/A is read twice, and
  # (CAA=1, the default since session 12) caa=recompiled: vanilla compiled afresh into empty
  # caches of its own, the compile A/A that aa and aa2 (sharing vanilla's compile) cannot be;
  # its cold compile costs the call ~30-45 s more
  el "vanilla A/A, pinning ${PINNING:-measure}"
  FLTUNE_E2E_TIME_LIMIT=$(lim 540) timeout ${TIMEOUT:-540} python3 -m fltune bench --e2e --model "$P" \
    --arm vanilla=vanilla --arm aa=vanilla --arm aa2=vanilla $([ "${CAA:-1}" = 1 ] && echo --arm caa=recompiled) \
    --reps ${REPS:-10} --warmup ${WARMUP:-1} \
    --scenarios "${SCENARIOS:-decode_b1,decode_b16,prefill_2048}" --pinning ${PINNING:-measure} \
    ${ENGINE:+--engine "$ENGINE"} --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['host'], indent=0)[:1500])" "$W/e2e-raw.json"
  python3 benchmarks/probe_check.py "$W/e2e-raw.json" | tee "$W/probe-check.txt"
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$W/log"; pack ;;
fijit) {
  # issue 11.5 / 12.2: build FlashInfer's kernels once (the GDN prefill JIT takes minutes; the
  # image has no prebuilt cubins and flashinfer.ai's jit-cache wheels are out of reach), check
  # the GDN and FlashInfer candidates, and bring the built modules back for .fiaot/
  el "FlashInfer JIT + GDN/FlashInfer candidates (benchmarks/gdn_flashinfer_check.py)"
  timeout ${TIMEOUT:-500} python3 benchmarks/gdn_flashinfer_check.py --out "$W/check.json"; echo "check rc=$?"
  pack_fi
  # issue 12.2: the GDN race with FlashInfer's prefill kernel now compiled, into PHASE=linrange's
  # DB (session 9's lin.db: linear + the shipped ops), with what is left of the call's time
  shipped_db
  left=$(call_left)
  el "calibrate the GDN ops ($left s left)"
  [ $left -gt 60 ] && timeout $left python3 -m fltune calibrate --model Qwen3.5-0.8B --db $DB \
    --ops gdn_chunk_prefill,gdn_decode --max-tokens ${MAXTOK:-8192} --quiet --json > "$W/gdn-calibrate.json"
  echo "calibrate rc=$?"
  python3 -m fltune report --db $DB --wide 2>&1 | grep -i -A3 "gdn" | head -60
  cp $DB "$W/"
  el done
} 2>&1 | tee "$W/log"; pack ;;
fibuild) {
  # FlashInfer's SM90 GDN prefill module alone (64 CUTLASS instantiations: over 5 minutes
  # on this machine's 16 cores in session 10, where it was built in pieces by three calls
  # that each timed out), nothing else running, ninja with MAX_JOBS; a call cut by its limit
  # leaves the objects built so far, and the next call goes on from there
  el "FlashInfer GDN prefill JIT, MAX_JOBS=${MAX_JOBS:-16}"
  MAX_JOBS=${MAX_JOBS:-16} timeout ${TIMEOUT:-540} python3 -c "
import time
t = time.time()
from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module
gen_gdn_prefill_sm90_module().build_and_load()
print('gdn_prefill_sm90 built and loaded in', round(time.time() - t, 1), 's')"; echo "build rc=$?"
  ls /tmp/s7/fiws/.cache/flashinfer/*/*/cached_ops/gdn_prefill_sm90/ 2>/dev/null | grep -c "\.o$" | sed 's/^/objects built: /'
  pack_fi
  el done
} 2>&1 | tee "$W/log"; pack ;;
gdnpick) {
  # issues 11.5 and 12.2/3: vLLM's GDN prefill kernel as an engine-wide pick measured by model
  # step (triton = FLA, flashinfer = vLLM's default on SM90) against vanilla (`auto`, its true
  # default, now that FlashInfer's JIT is built: PHASE=fijit first, or a carried .fiaot/)
  shipped_db
  el "engine pick ${CHOICE:-gdn_prefill_backend=triton,flashinfer}, pinning ${PINNING:-measure}"
  FLTUNE_E2E_PINNING=${PINNING:-measure} FLTUNE_E2E_TIME_LIMIT=$(lim 450) \
    timeout ${TIMEOUT:-450} python3 -m fltune adjudicate \
    --model "$P" --db $DB --engine-choice "${CHOICE:-gdn_prefill_backend=triton,flashinfer}" \
    --reps ${REPS:-5} --warmup 1 --scenarios "${SCENARIOS:-decode_b1,prefill_2048,prefill_8192}" \
    ${COMPILE_AA:+--compile-aa $COMPILE_AA} \
    --out "$W/adj" --json > "$W/pick.json"; echo "adjudicate rc=$?"
  python3 -m fltune report --db $DB --wide 2>&1 | sed -n '/engine-wide/,$p' | head -30
  [ -f "$W/adj/e2e-raw.json" ] && python3 benchmarks/probe_check.py "$W/adj/e2e-raw.json" | tee "$W/probe-check.txt"
  [ -f "$W/adj/e2e-raw.json" ] && python3 benchmarks/profile_round_check.py "$W/adj/e2e-raw.json" \
    --json "$W/profile-rounds.json" | tee "$W/profile-rounds.txt"
  cp $DB "$W/"
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  rm -rf "$W"/*/model
  el done
} 2>&1 | tee "$W/log"; pack ;;
q06) {
  # issues 11 / 12 (the shipped DB's goal): Qwen3-0.6B's GEMMs calibrated into the shipped
  # DB's copy (one max-autotune compile per shape, as session 6 did for Qwen3.5: 440 s cold
  # there for 7 shapes), then decided per token range by model step (--compile-aa: on CUDA by
  # default) with what is left of the call; then PHASE=gdnpick with P=Qwen3-0.6B
  # CHOICE=attention_backend=TRITON_ATTN for its engine pick
  shipped_db
  el "calibrate $P linear (FLTUNE_AUTOTUNE_MAX_TOKENS=${AUTOTUNE:-1})"
  FLTUNE_AUTOTUNE_MAX_TOKENS=${AUTOTUNE:-1} timeout ${CAL_S:-330} python3 -m fltune calibrate \
    --model "$P" --ops linear --max-tokens ${MAXTOK:-8192} --candidate-timeout 300 --db $DB \
    --quiet --json > "$W/calibrate-linear.json"; echo "calibrate rc=$?"
  python3 -m fltune report --db $DB --op linear --wide 2>&1 | head -70
  left=$(call_left)
  el "adjudicate linear per range ($left s left)"
  [ $left -gt 150 ] && adjudicate_linear_per_range $(( left - 40 )) $(( left - 10 )) ${REPS:-10}
  keep_decisions
  el done
} 2>&1 | tee "$W/log"; pack ;;
coldlin) {
  # session 20's --cold-weights (tune/cold_weights.py): PROFILE's `linear` decode bands
  # (<= 512 tokens) re-raced with each weight rotated through copies that overflow L2, into
  # the shipped DB's copy; `fltune diff` against the DB before says which picks moved (session
  # 19: FlagGems' mm won Qwen3-0.6B's down projection at 33-128 tokens with the weight hot and
  # lost in the model). Then, with what is left, the per-range adjudication (EDGES, SCENARIOS)
  shipped_db; cp $DB "$W/before.db"
  el "calibrate $P linear --cold-weights --force --max-tokens 512"
  FLTUNE_AUTOTUNE_MAX_TOKENS=${AUTOTUNE:-1} timeout ${CAL_S:-300} python3 -m fltune calibrate \
    --model "$P" --ops linear --max-tokens 512 --cold-weights --force --candidate-timeout 200 \
    --db $DB --quiet --json > "$W/calibrate-linear-cold.json"; echo "calibrate rc=$?"
  # the moved bands only (session 21: `--all | head -80` showed other ops' rows and cut
  # every linear one); every band as JSON beside it
  python3 -m fltune diff "$W/before.db" $DB --wide 2>&1
  python3 -m fltune diff "$W/before.db" $DB --all --json > "$W/diff.json"
  left=$(call_left)
  if [ -n "${ADJ:-}" ] && [ $left -gt 200 ]; then
    el "adjudicate linear per range ($left s left)"
    adjudicate_linear_per_range $(( left - 40 )) $(( left - 10 )) ${REPS:-5}
  fi
  rm -f "$W/before.db"; keep_decisions
  el done
} 2>&1 | tee "$W/log"; pack ;;
caa) {
  # the compile A/A arm alone beside vanilla (session 13: its start, once 296 s with every
  # compile cache off, now a cold compile into caches of its own), a few repetitions
  el "vanilla vs caa=recompiled"
  FLTUNE_E2E_TIME_LIMIT=$(lim 170) timeout ${TIMEOUT:-170} python3 -m fltune bench --e2e --model "$P" \
    --arm vanilla=vanilla --arm caa=recompiled --reps ${REPS:-3} --warmup 1 \
    --scenarios "${SCENARIOS:-decode_b1}" --pinning ${PINNING:-measure} \
    --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  grep -h "init engine\|Compiling a graph\|Directly load\|saved AOT\|torch.compile took" "$W"/worker-*.log | cut -c1-220
  python3 -c "
import json; d = json.load(open('$W/e2e-raw.json'))
print({a: i.get('start_s') for a, i in d['arms'].items()})
for p in d['points']: print({k: p.get(k) for k in ('scenario', 'arm', 'n', 'ratio_median', 'ci_low', 'ci_high', 'kernel_us_arm', 'kernel_us_vanilla', 'kernel_ci_low', 'kernel_ci_high')})"
  el done
} 2>&1 | tee "$W/log"; pack ;;
draw) {
  # session 26: Inductor's first-call autotune of an op (OP, default rms_norm_gated) drawn
  # DRAWS times, each in a fresh process and Inductor cache (benchmarks/autotune_draw.py)
  el "autotune draws of ${OP:-rms_norm_gated} ($P)"
  timeout ${TIMEOUT:-480} python3 benchmarks/autotune_draw.py --profile "$P" \
    --op "${OP:-rms_norm_gated}" --draws ${DRAWS:-6} --out "$W"
  echo "autotune_draw rc=$?"
  el done
} 2>&1 | tee "$W/log"; pack ;;
native) {
  # issue 11.1: native.vllm's kernels against the same ops' kernels inside the model (one
  # profiler each, benchmarks/native_in_model.py), with fresh compile caches so that both
  # sides' Inductor code comes back for attribution (inductor-code.tgz: every output module)
  el "native.vllm against $P in the model"
  VLLM_CACHE_ROOT=$W/vcache TORCHINDUCTOR_CACHE_DIR=$W/icache VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    timeout ${TIMEOUT:-480} python3 benchmarks/native_in_model.py --profile "$P" --out "$W" \
    --impls ${IMPLS:-native.vllm} ${SKIPMODEL:+--skip-model} ${NATIVE_OPS:+--ops $NATIVE_OPS} \
    --scenarios "${SCENARIOS:-decode_b1,decode_b16,decode_b64,prefill_2048,prefill_8192}"
  echo "native_in_model rc=$?"
  grep -rl "def call(" "$W/vcache" "$W/icache" 2>/dev/null > "$W/code-files.txt"
  # (and the autotune's picks: Inductor's .best_config beside each tuned kernel)
  find "$W/vcache" "$W/icache" -name '*.best_config' 2>/dev/null >> "$W/code-files.txt"
  tar -czf "$W/inductor-code.tgz" -T "$W/code-files.txt" 2>/dev/null
  echo "$(wc -l < "$W/code-files.txt") output modules packed"; rm -rf "$W/vcache" "$W/icache"
  el done
} 2>&1 | tee "$W/log"; pack ;;
opsadj) {
  # issue 11.3 for the picks PHASE=fiops changed (FlashInfer's): each model's ops decided by
  # model step (per op; --compile-aa on by default on CUDA), the call's time shared out
  shipped_db
  # (OPS06= or OPS35= empty skips that model: session 14 decided Qwen3-0.6B's alone)
  for spec in "Qwen3-0.6B:${OPS06-rotary_embedding,silu_and_mul}" \
              "Qwen3.5-0.8B:${OPS35-silu_and_mul,gemma_rms_norm,gemma_fused_add_rms_norm}"; do
    [ -n "${spec#*:}" ] || continue
    m=${spec%%:*}; left=$(( $(call_left) - 20 ))
    # (Qwen3-0.6B gets half of the call only when Qwen3.5 follows it)
    [ "$m" = Qwen3-0.6B ] && [ -n "${OPS35-x}" ] && left=$(( left / 2 ))
    el "adjudicate $m ${spec#*:} ($left s)"
    [ $left -gt 120 ] && FLTUNE_E2E_TIME_LIMIT=$(( left - 30 )) timeout $left python3 -m fltune \
      adjudicate --db $DB --model "$m" --ops "${spec#*:}" --reps ${REPS:-8} --warmup 1 \
      --scenarios "${SCENARIOS:-decode_b1,decode_b16,prefill_2048}" --out "$W/adj-$m" --json \
      > "$W/adjudicate-$m.json"; echo "adjudicate rc=$?"
  done
  keep_decisions
  el done
} 2>&1 | tee "$W/log"; pack ;;
fiops) {
  # issue 12.4: FlashInfer's norm / activation / rope kernels raced in calibration (session 12
  # built and parity-checked their modules: .fiaot/ops-fiaot.tgz, restored above) for the ops
  # the shipped DB had raced without them, both models, into the shipped DB's copy (--force:
  # the bands are re-raced with every candidate, the old rows replaced)
  shipped_db
  # (OPS35= or OPS06= empty skips that model: session 23 re-raced Qwen3-0.6B's rope alone;
  # FORCE=0 resumes instead: only bands missing, or raced for another context or timing
  # regime, are raced, e.g. MAXTOK=16384 for a band above the last race's)
  for spec in "Qwen3.5-0.8B:${OPS35-gemma_rms_norm,gemma_fused_add_rms_norm,silu_and_mul}" \
              "Qwen3-0.6B:${OPS06-silu_and_mul,rotary_embedding}"; do
    [ -n "${spec#*:}" ] || continue
    left=$(( $(call_left) - 20 ))
    el "calibrate ${spec%%:*} ${spec#*:} FORCE=${FORCE:-1} ($left s left)"
    [ $left -gt 30 ] && timeout $left python3 -m fltune calibrate --model "${spec%%:*}" --db $DB \
      --ops "${spec#*:}" --max-tokens ${MAXTOK:-8192} $([ "${FORCE:-1}" = 1 ] && echo --force) \
      --quiet --json \
      > "$W/calibrate-${spec%%:*}.json"; echo "calibrate rc=$?"
  done
  python3 -m fltune report --db $DB --wide 2>&1 | grep -B2 -A20 "silu_and_mul\|gemma\|rotary" | head -150
  cp $DB "$W/"
  el done
} 2>&1 | tee "$W/log"; pack ;;
linrange) {
  shipped_db    # (session 13 on: the shipped DB holds both models' `linear` races)
  el "adjudicate linear per range"
  adjudicate_linear_per_range $(lim 540) ${TIMEOUT:-540} ${REPS:-5}
  keep_decisions
  el done
} 2>&1 | tee "$W/log"; pack ;;
linbench) {
  # the served DB (the shipped DB's copy with every decision the earlier phases stored)
  # against vanilla with its true defaults: issue 11's e2e-summary.json for model P;
  # FL=1 adds the fixed FL order's arm (every op routed as vllm-plugin-FL would); FLONLY=1
  # runs it without the calibrated arm (its engine starts in ~5 min on Qwen3.5, FlagGems'
  # kernels compiled at every capture size: session 17 got one repetition with both beside it)
  shipped_db
  CALARM="--arm calibrated=db:$DB"; FLARM=
  # NOCAL=1: no calibrated arm (an A/A run: vanilla and its A/A processes only)
  [ "${NOCAL:-0}" = 1 ] && CALARM=
  # RELABEL=1 (a DIAGNOSTIC, benchmarks/relabel_manifest.py): on a card other than the DB's
  # (an H100 lent for the H200's DB) the DB's picks for RELABEL_FROM (default H200) are
  # frozen and re-labelled for this card, so the arm routes what it routes on the H200
  # instead of falling back to vanilla; its figures say nothing about this card's best picks
  if [ "${RELABEL:-0}" = 1 ] && [ -n "$CALARM" ]; then
    python3 -m fltune freeze --db $DB --device "${RELABEL_FROM:-H200}" --out "$W/manifest-src.json" >/dev/null \
      && python3 benchmarks/relabel_manifest.py "$W/manifest-src.json" "$W/manifest-relabelled.json" \
      && CALARM="--arm calibrated=manifest:$W/manifest-relabelled.json" \
      || { echo "RELABEL: freezing or relabelling failed: no calibrated arm"; CALARM=; }
  fi
  [ "${FLONLY:-0}" = 1 ] && { FL=1; CALARM=; }
  if [ -n "${FL:-}" ]; then
    python3 -m fltune freeze --db $DB --order fl --out "$W/manifest-fl.json" >/dev/null \
      && FLARM="--arm fl=manifest:$W/manifest-fl.json:all"
    # without its arm an FLONLY run would be a plain A/A under the usual summary's name
    [ -z "$FLARM" ] && [ -z "$CALARM" ] && { echo "freezing the FL order failed: no FL arm, no run"; exit 1; }
  fi
  # WARMONLY=1: every arm compiles into this machine's caches, one repetition of decode_b1 as
  # started, nothing else. On a cold machine the compiles (calibrated: ~240 s on Qwen3.5) and
  # the restarts to a loaded state leave a 10-minute call about one measured repetition
  # (session 29); after a WARMONLY call the measuring call on the same warm machine should
  # start every arm loaded (one model path per config, session 29: not yet seen on the GPU;
  # state_summary prints each arm's state) and measure for most of its time.
  WARMARGS=
  [ "${WARMONLY:-0}" = 1 ] && { REPS=1; SCENARIOS=decode_b1; START_STATE=as-started; WARMARGS="--warmup 0"; PROCS=; GENERATIONS=; }
  # PROCS=K: `--procs K`, every arm in K worker processes (vanilla, vanilla.p2, ...), each
  # timed in every repetition; the point's CI resamples the processes, and each point says
  # how far each process sat from its arm (process_offsets_pct; session 33: one A/A process
  # read ~1 % faster than vanilla at every point of a run). Until session 34 PROCS=K added
  # K-2 A/A arms (aa2, aa3, ...) instead.
  # Memory (session 35, H100): an engine of Qwen3-0.6B holds ~9.4 GiB, and vLLM starts one
  # only with 0.2 x the card free; NOCAL=1 PROCS=4 (8 engines) fitted, but vanilla's restart
  # to a loaded engine came after the other seven and was refused: WARMONLY=1 first.
  # GENERATIONS=G: `--generations G`, every worker started again G-1 times in the run (the
  # repetitions in G blocks): a process's own offset, ~1 % at a 2048-token prefill, averages
  # over processes x generations (session 43: benchmarks/aa_design.py says how many)
  # ENGINE='{...}': engine arguments over the instrument's defaults for EVERY arm, vanilla
  # included (session 36: the wall A/A with CUDA graphs up to 2048 tokens,
  # ENGINE='{"compilation_config": {"max_cudagraph_capture_size": 2048}}'); an arm's DB
  # pick of the same setting then yields to it (engine_pick.served_engine_overlay)
  # AA=recompiled: the A/A arm is vanilla compiled afresh (its kernel CI is the compile
  # A/A floor: one draw of Inductor's autotuning, which a calibrated arm also compiles)
  AAARMS="--arm aa=${AA:-vanilla}"
  # XARMS="caa2=recompiled caa3=recompiled": more arms beside them (session 38: three compile
  # draws of vanilla, so the spread of Inductor's draws is read before a served arm's effect)
  for a in ${XARMS:-}; do AAARMS="$AAARMS --arm $a"; done
  el "served DB against vanilla ${FLARM:-} ${WARMARGS:+(WARMONLY: compiling the arms)}"
  FLTUNE_E2E_TIME_LIMIT=$(lim 540) timeout ${TIMEOUT:-540} python3 -m fltune bench --e2e --model "$P" --db $DB \
    --arm vanilla=vanilla $AAARMS $CALARM ${FLARM:-} --reps ${REPS:-8} $WARMARGS \
    ${ENGINE:+--engine "$ENGINE"} \
    --scenarios "${SCENARIOS:-decode_b1,decode_b16,prefill_2048}" --pinning ${PINNING:-shared} \
    ${START_STATE:+--start-state $START_STATE} ${HOSTPROF:+--host-profile} ${INNER:+--inner $INNER} \
    ${INTERLEAVE:+--interleave $INTERLEAVE} ${PROCS:+--procs $PROCS} ${GENERATIONS:+--generations $GENERATIONS} \
    --out "$W" --json > "$W/e2e.json"; echo "bench rc=$?"
  state_summary "$W/e2e-raw.json"
  # HOSTPROF=1: where each arm's host time goes beyond vanilla's (cProfile), top 5 per point
  [ -n "${HOSTPROF:-}" ] && python3 -c "
import json; d = json.load(open('$W/e2e-summary.json'))
for sc, per in (d.get('host_extra') or {}).items():
    for arm, x in per.items():
        print(sc, arm, {k: x.get(k) for k in ('run_s_arm', 'run_s_baseline', 'own_time_extra_us')})
        for f in x.get('functions') or []: print('   ', round(f['extra_us']), f['func'][:150])"
  find "$W" -name '*.log' -size +200k -exec gzip {} \;
  el done
} 2>&1 | tee "$W/log"; cp "$W/e2e-summary.json" "$OUT/e2e-summary-$P.json" 2>/dev/null; pack ;;
esac
