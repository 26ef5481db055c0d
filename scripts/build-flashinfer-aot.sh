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
rm -rf "$W/aot" "$W/pack" && mkdir -p "$W/aot" "$W/pack"
"$W/venv/bin/python" - "$W/src" "$W/aot" "${MODS[@]}" <<'PY'
import os, shutil, sys, time, types
src, aot, mods = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, src)
# a bare package: flashinfer/__init__.py imports the whole library (and wants a GPU)
pkg = types.ModuleType("flashinfer"); pkg.__path__ = [os.path.join(src, "flashinfer")]
sys.modules["flashinfer"] = pkg
from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module
from flashinfer.jit.sampling import gen_sampling_module
gens = {"gdn_prefill_sm90": gen_gdn_prefill_sm90_module, "sampling": gen_sampling_module}
for name in mods:
    if name not in gens:
        sys.exit(f"unknown module {name!r}: one of {sorted(gens)} (add its generator here)")
    spec, t = gens[name](), time.time()
    assert spec.name == name, (spec.name, name)
    spec.build(verbose=False, need_lock=True)
    os.makedirs(os.path.join(aot, name), exist_ok=True)      # this run's modules only
    shutil.copy2(spec.jit_library_path, os.path.join(aot, name, f"{name}.so"))
    print(f"{name}: {len(spec.sources)} sources, built in {time.time() - t:.0f} s", flush=True)
PY
# modules already in .fiaot/ (built earlier, or on the GPU machine by FlashInfer itself) are
# kept beside the ones built now; a module built now replaces its old copy
mkdir -p .fiaot
if ls .fiaot/fiaot.tgz.part* >/dev/null 2>&1; then
  cat $(ls .fiaot/fiaot.tgz.part* | sort) | tar -xz -C "$W/pack"
fi
cp -r "$W"/aot/* "$W/pack/"
rm -f .fiaot/fiaot.tgz.part*
(cd "$W/pack" && tar -czf "$W/fiaot.tgz" */*.so)
split -b 15M -d -a 1 "$W/fiaot.tgz" .fiaot/fiaot.tgz.part
{ echo "FlashInfer $FI_VERSION AOT modules for sm_90a; $(date -Is) scripts/build-flashinfer-aot.sh built: ${MODS[*]}"
  nvcc --version | tail -1; (cd "$W/pack" && ls -la */*.so && sha256sum */*.so); } > .fiaot/README.txt
log "done: $(ls .fiaot | tr '\n' ' ')"
