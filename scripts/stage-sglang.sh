#!/usr/bin/env bash
# Stage SGLang for the GPU machine (H200: Python 3.12, torch 2.11.0+cu130, no internet), for
# benchmarks/h200_sglang.sh.
#
# Which SGLang: 0.5.17, the newest release that pins torch==2.11.0, the H200 image's torch
# (0.5.11-0.5.17 pin 2.11.0; 0.5.18-0.5.21 pin 2.13.0, CI's CPU torch; 0.5.22-0.5.23 pin
# 2.14.1). It has the sglang.srt.plugins loader (since 0.5.11) and MultiPlatformOp layers;
# CI tests 0.5.21 (BaseFusedOp layers): the plugin handles both (fltune/integrations/sglang).
#
# What travels (beside vLLM 0.24's stage, ../shared/device/stage-vllm.sh, whose /tmp/vsite
# supplies fastapi, pydantic, pyzmq, msgspec, uvicorn, openai, ... and goes after SGLang's
# folder on PYTHONPATH): sglang 0.5.17 (cp312), sglang-kernel 0.4.5, the flashinfer-python,
# xgrammar, apache-tvm-ffi versions SGLang pins, and the few small packages vLLM does not
# need (orjson, gguf, torchao, torch_memory_saver). Extra names: SGLANG_STAGE_EXTRA="a==1 b".
#
# sglang-kernel is 383 MB, 94 % of it FlashAttention-3 (sgl_kernel/flash_ops.abi3.so, loaded
# only by the fa3 attention backend: sgl_kernel/flash_attn.py). By default the wheel is
# repacked without it (same name and version, its RECORD line removed) and
# benchmarks/h200_sglang.sh serves with --attention-backend triton on both arms.
# SGLANG_STAGE_FA3=1 keeps the whole wheel (then about 10 folders to carry, not 4).
#
# Why chunks: a device call carries at most 64 MiB of working tree, the checkout included, so
# the parts go in folders .sgc1 .. .sgcN of at most SGLANG_CHUNK_MIB (default 45, never over
# 50), carried one per call while the machine stays warm; benchmarks/h200_sglang.sh joins
# and installs them into /tmp/sgsite once per machine.
#
# Run here, in the checkout, where pip reaches PyPI: scripts/stage-sglang.sh
# Everything it writes (.sgstage/, .sgc1 ...) is ignored (.gitignore, .git/info/exclude).
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
cap_mib=${SGLANG_CHUNK_MIB:-45}
if [ "$cap_mib" -gt 50 ] || [ "$cap_mib" -lt 8 ]; then
  echo "stage-sglang.sh: SGLANG_CHUNK_MIB=$cap_mib: use 8..50 (a call carries at most 64 MiB, the checkout included)" >&2
  exit 2
fi
stage=.sgstage
exclude() { grep -qx "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude; }
exclude "$stage"
mkdir -p "$stage/dl"
# transformers/tokenizers: SGLang 0.5.17 pins transformers==5.12.1 (the image's 5.17.0 already
# registers 'qwen3_asr', which SGLang registers again: ValueError at import), and 5.12.1 wants
# tokenizers <= 0.23.0 (the image has 0.23.2). IPython and its pure-Python deps: sglang/utils.py
# imports IPython.display at `import sglang` (the image has none). All found on the H200,
# 2026-12-01 (benchmarks/results/h200-2026-12-01-s7/sglang-attempt).
pkgs=(sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 xgrammar==0.2.1
      apache-tvm-ffi==0.1.11 orjson==3.13.0 gguf==0.19.0 torchao==0.17.0
      torch_memory_saver==0.0.9.post1 transformers==5.12.1 tokenizers==0.22.2
      ipython==9.9.0 ipython_pygments_lexers==1.1.1 decorator==5.3.1 jedi==0.20.1 parso==0.8.7
      matplotlib_inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53
      wcwidth==0.9.4 pygments==2.21.0 stack_data==0.6.3 asttokens==3.0.2 executing==2.3.0
      pure_eval==0.2.4 traitlets==5.16.1 ${SGLANG_STAGE_EXTRA:-})
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$stage/dl" "${pkgs[@]}" 2>&1 | grep -v '^WARNING' || true
for want in "sglang-0.5.17-cp312" "sglang_kernel-0.4.5-" "flashinfer_python-0.6.15.post1-"; do
  ls "$stage/dl/$want"*.whl >/dev/null 2>&1 \
    || { echo "stage-sglang.sh: $want*.whl did not download (pip's output above)" >&2; exit 1; }
done
rm -rf "$stage/out" .sgc[0-9]*
mkdir -p "$stage/out"
n=$(python3 - "$stage" "$cap_mib" "${SGLANG_STAGE_FA3:-0}" <<'PY'
import os, shutil, sys, zipfile
sys.path.insert(0, "scripts")
from carry_pack import MiB, first_fit, link_bins, split
stage, cap, keep_fa3 = sys.argv[1], int(sys.argv[2]) * MiB, sys.argv[3] == "1"
dl, out = os.path.join(stage, "dl"), os.path.join(stage, "out")
for f in sorted(os.listdir(dl)):
    src = os.path.join(dl, f)
    if f.startswith("sglang_kernel-") and not keep_fa3:
        # the same wheel (name and version unchanged: SGLang checks the version) without
        # FA3's library; RECORD without its line
        dst = os.path.join(out, f)
        with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
            for info in zi.infolist():
                if info.filename == "sgl_kernel/flash_ops.abi3.so":
                    continue
                data = zi.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(l for l in data.splitlines(True)
                                    if not l.startswith(b"sgl_kernel/flash_ops.abi3.so,"))
                zo.writestr(info, data)
    else:
        shutil.copy(src, os.path.join(out, f))
items = []
for f in sorted(os.listdir(out)):
    p = os.path.join(out, f)
    if os.path.getsize(p) > cap - MiB:                    # too big for one folder: parts
        items += split(p, cap - MiB, lambda i: os.path.join(out, f"{f}.part{i:03d}"))
        os.remove(p)
    else:
        items.append(p)
print(link_bins(first_fit(items, cap), ".sgc"))
PY
)
for k in $(seq 1 "$n"); do exclude ".sgc$k"; done
du -sh .sgc[0-9]*
echo
echo "SGLang staged in $n folders of at most $cap_mib MiB. On the GPU machine, after vLLM's stage"
echo "(/tmp/vsite, scripts/stage-vllm.sh), make these calls back to back while it stays warm:"
python3 scripts/carry_pack.py calls .sgc "$n" /tmp/sgstage "bash benchmarks/h200_sglang.sh"
echo "(benchmarks/h200_sglang.sh joins the parts and installs SGLang into /tmp/sgsite once per machine;"
echo " .whl must hold a fltune wheel built from this checkout: pip wheel --no-deps -w .whl .)"
