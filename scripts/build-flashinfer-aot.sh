#!/usr/bin/env bash
# Cross-compile FlashInfer's JIT modules for the H200 (sm_90a) here, on a CPU machine, into
# .fiaot/ (git-ignored), which benchmarks/h200_s7.sh unpacks into FlashInfer's AOT directory on
# the GPU machine, where JitSpec.build_and_load loads <AOT>/<name>/<name>.so without building.
#
# Why: vLLM 0.24's defaults on Hopper run two FlashInfer modules that FlashInfer JIT-compiles
# on first use, and the GPU image has no prebuilt ones (flashinfer-jit-cache is not on PyPI):
#   gdn_prefill_sm90  the GDN prefill kernel (gdn_prefill_backend="auto"): 66 CUTLASS sources,
#                     ~10 minutes of the GPU machine's 16 cores (session 10), a third of a
#                     session's device time; here ~70 min on 2 cores, no device time at all;
#   sampling          the top-k/top-p sampler: 130 s of a cold machine's first engine start
#                     (session 11).
# Nothing here needs a GPU: FlashInfer's own code writes the build (sources, flags, module
# name), nvcc comes from NVIDIA's PyPI wheels at torch 2.11.0+cu130's CUDA (13.0), and the
# modules are TVM-FFI libraries, not CPython extensions, so this Python's version does not
# matter. Start it early in a session (in the background: nohup ... &) and carry .fiaot/.
#
#   scripts/build-flashinfer-aot.sh [MODULE ...]     (default: sampling gdn_prefill_sm90)
#   MAX_JOBS (default: the cores), FIAOT_WORK (default /tmp/fiaot-build)
#
# Attention (--attention-backend FLASHINFER on SM90; vLLM's default there is FLASH_ATTN):
#   attn-hd<N>         the two batch-prefill modules vLLM 0.24's FlashInfer backend JITs on
#                      SM90 for a bf16 model, kv_cache_dtype auto, no sliding window/soft cap:
#                      prefill wrapper (backend "auto" -> fa3 on sm90a: uri ..._sm90) and the
#                      tensor-core decode wrapper (use_tensor_cores=True, backend "auto" -> fa2
#                      for non-fp8: uri without _sm90), both dtype_idx int32, head_dim N
#   attn-qwen3-0.6b    = attn-hd128 (Qwen3-0.6B)      attn-qwen3.5 = attn-hd256 (Qwen3.5-0.8B)
#   (.fiaot/attn-README.txt says why.) These go into their own .fiaot/attn-fiaot.tgz (added to
#   the modules already in it), which h200_s7.sh's *-fiaot.tgz restore unpacks; fiaot.tgz.part*
#   and README.txt are then left alone. E.g. (slow: ~1 h per model on 2 cores)
#   MAX_JOBS=1 nohup nice -n 19 scripts/build-flashinfer-aot.sh attn-qwen3-0.6b attn-qwen3.5 \
#     > /tmp/fiaot-attn.log 2>&1 &
# (the sampler includes curand.h: nvidia-curand; versions = what torch 2.11.0+cu130 pins)
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
W=${FIAOT_WORK:-/tmp/fiaot-build}
MODS=("$@"); [ ${#MODS[@]} -gt 0 ] || MODS=(sampling gdn_prefill_sm90)
FI_VERSION=0.6.12 TVM_FFI=0.1.9            # = scripts/vllm-0.24-deps.txt
mkdir -p "$W"
log() { echo "$(date -Is) $*" | tee -a "$W/STATUS.txt"; }
if [ ! -f "$W/venv/.ready" ]; then
  log "venv: FlashInfer $FI_VERSION sources, TVM-FFI $TVM_FFI, CUDA 13.0 nvcc + headers"
  python3 -m venv "$W/venv"
  # torch only for FlashInfer's build helpers (its C++ ABI flag): the CPU wheel, as setup.sh
  "$W/venv/bin/pip" install -q "torch==2.13.0"
  "$W/venv/bin/pip" install -q "apache-tvm-ffi==$TVM_FFI" ninja filelock jinja2 packaging numpy \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" \
    "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-curand==10.4.0.35"
  "$W/venv/bin/pip" download -q --no-deps "flashinfer-python==$FI_VERSION" -d "$W/whl"
  rm -rf "$W/src" && mkdir -p "$W/src" && (cd "$W/src" && python3 -m zipfile -e "$W"/whl/flashinfer_python-*.whl .)
  touch "$W/venv/.ready"
fi
CU=$("$W/venv/bin/python" -c "import nvidia, os; print(os.path.join(next(iter(nvidia.__path__)), 'cu13'))")
# FlashInfer links with -L$CUDA_HOME/lib64 -L.../lib64/stubs -lcudart -lcuda, the layout of a
# CUDA toolkit install, which the PyPI wheels lack: lib64 -> lib, the unversioned libcudart.so,
# and a stub libcuda.so (soname libcuda.so.1, no symbols: the modules call the driver through
# the runtime, and the H200-built sampler needs no libcuda either: `readelf -d`)
[ -e "$CU/lib64" ] || ln -s lib "$CU/lib64"
[ -e "$CU/lib/libcudart.so" ] || ln -s libcudart.so.13 "$CU/lib/libcudart.so"
if [ ! -f "$CU/lib/stubs/libcuda.so" ]; then
  mkdir -p "$CU/lib/stubs" && echo > "$W/empty.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$W/empty.c"
fi
export PATH="$CU/bin:$W/venv/bin:$PATH" CUDA_HOME="$CU" CUDA_VISIBLE_DEVICES=
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$W/ws" MAX_JOBS=${MAX_JOBS:-$(nproc)}
nvcc --version | tail -2
log "building ${MODS[*]} (MAX_JOBS=$MAX_JOBS)"
OTH=(); ATT=()
for m in "${MODS[@]}"; do case $m in attn-*) ATT+=("$m");; *) OTH+=("$m");; esac; done
rm -rf "$W/aot" "$W/pack" "$W/aot-attn" "$W/pack-attn" && mkdir -p "$W/aot" "$W/pack" "$W/aot-attn"
"$W/venv/bin/python" - "$W/src" "$W/aot" "$W/aot-attn" "${MODS[@]}" <<'PY'
import os, re, shutil, sys, time, types
src, aot, aot_attn, mods = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sys.path.insert(0, src)
# a bare package: flashinfer/__init__.py imports the whole library (and wants a GPU)
pkg = types.ModuleType("flashinfer"); pkg.__path__ = [os.path.join(src, "flashinfer")]
sys.modules["flashinfer"] = pkg
from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module
from flashinfer.jit.sampling import gen_sampling_module
gens = {"gdn_prefill_sm90": gen_gdn_prefill_sm90_module, "sampling": gen_sampling_module}
# attention: the generator calls that get_batch_prefill_module() makes from vLLM 0.24's plan()
# calls (flashinfer/prefill.py BatchPrefillWithPagedKVCacheWrapper.plan, flashinfer/decode.py
# BatchDecodeWithPagedKVCacheWrapper.plan with use_tensor_cores): q/kv/o bf16, indptr int32,
# head_dim_qk = head_dim_vo, PosEncodingMode NONE (0), no sliding window, no logits soft cap,
# no fp16 qk reduction; decode (fa2) first, then prefill (fa3)
ALIAS = {"attn-qwen3-0.6b": "attn-hd128", "attn-qwen3.5": "attn-hd256"}
def attn(backend, hd):
    import torch
    from flashinfer.jit.attention.modules import gen_batch_prefill_module
    return gen_batch_prefill_module(backend, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                                    torch.int32, hd, hd, 0, False, False, False)
todo = []
for name in mods:
    m = re.fullmatch(r"attn-hd(\d+)", ALIAS.get(name, name))
    if m:
        todo += [(lambda b=b, hd=int(m[1]): attn(b, hd), None, aot_attn) for b in ("fa2", "fa3")]
    elif name in gens:
        todo.append((gens[name], name, aot))
    else:
        sys.exit(f"unknown module {name!r}: one of {sorted(gens)}, attn-hd<N>, {sorted(ALIAS)}"
                 " (add its generator here)")
for gen, name, out in todo:
    spec, t = gen(), time.time()
    assert name is None or spec.name == name, (spec.name, name)
    name = spec.name
    print(f"{name}: {len(spec.sources)} sources ...", flush=True)
    spec.build(verbose=False, need_lock=True)
    os.makedirs(os.path.join(out, name), exist_ok=True)      # this run's modules only
    shutil.copy2(spec.jit_library_path, os.path.join(out, name, f"{name}.so"))
    print(f"{name}: {len(spec.sources)} sources, built in {time.time() - t:.0f} s", flush=True)
PY
mkdir -p .fiaot
# attention modules: their own .fiaot/attn-fiaot.tgz (the ones already in it are kept, a module
# built now replaces its old copy), listed with sizes and sha256 in .fiaot/attn-fiaot.txt
if [ ${#ATT[@]} -gt 0 ]; then
  mkdir -p "$W/pack-attn"
  [ -f .fiaot/attn-fiaot.tgz ] && tar -xzf .fiaot/attn-fiaot.tgz -C "$W/pack-attn"
  cp -r "$W"/aot-attn/* "$W/pack-attn/"
  (cd "$W/pack-attn" && tar -czf "$W/attn-fiaot.tgz" */*.so)
  cp "$W/attn-fiaot.tgz" .fiaot/attn-fiaot.tgz
  { echo "FlashInfer $FI_VERSION AOT attention modules for sm_90a; $(date -Is) scripts/build-flashinfer-aot.sh built: ${ATT[*]} (attn-fiaot.tgz holds all below)"
    nvcc --version | tail -1; (cd "$W/pack-attn" && ls -la */*.so && sha256sum */*.so)
    sha256sum .fiaot/attn-fiaot.tgz; } > .fiaot/attn-fiaot.txt
fi
if [ ${#OTH[@]} -eq 0 ]; then log "done: $(ls .fiaot | tr '\n' ' ')"; exit 0; fi
# modules already in .fiaot/ (built earlier, or on the GPU machine by FlashInfer itself) are
# kept beside the ones built now; a module built now replaces its old copy
if ls .fiaot/fiaot.tgz.part* >/dev/null 2>&1; then
  cat $(ls .fiaot/fiaot.tgz.part* | sort) | tar -xz -C "$W/pack"
fi
cp -r "$W"/aot/* "$W/pack/"
rm -f .fiaot/fiaot.tgz.part*
(cd "$W/pack" && tar -czf "$W/fiaot.tgz" */*.so)
split -b 15M -d -a 1 "$W/fiaot.tgz" .fiaot/fiaot.tgz.part
{ echo "FlashInfer $FI_VERSION AOT modules for sm_90a; $(date -Is) scripts/build-flashinfer-aot.sh built: ${OTH[*]}"
  nvcc --version | tail -1; (cd "$W/pack" && ls -la */*.so && sha256sum */*.so); } > .fiaot/README.txt
log "done: $(ls .fiaot | tr '\n' ' ')"
