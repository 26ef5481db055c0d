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
# Run after scripts/setup.sh (it needs .venv). Idempotent. Prints one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${FLTUNE_BASE_VENV:-$ROOT/.venv}
VENV=${FLTUNE_SGLANG_VENV:-$ROOT/.venv-sglang}
SGLANG_VERSION=0.5.21
# what `import sglang.srt.layers.*` and the plugin loader need beyond .venv, pinned
EXTRA=(torchvision==0.28.0 orjson)
T0=$SECONDS
step() { printf '\n==> [sglang %s, %ss] %s\n' "$1" "$((SECONDS - T0))" "$2"; }
fail() { printf '\nsetup_sglang.sh: FAILED: %s\n' "$*" >&2; exit 1; }

[ -x "$BASE/bin/python" ] || fail "no base venv at $BASE (run scripts/setup.sh first)"
step 1/4 "venv $VENV over $BASE"
[ -x "$VENV/bin/python" ] || "$BASE/bin/python" -m venv --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE_SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the base venv's packages after this venv's own (addsitedir also runs its .pth files:
# fltune's editable install); then the torchvision fix, which only adds an import hook
printf 'import site; site.addsitedir(%s)\n' "'$BASE_SITE'" > "$SITE/00_fltune_base_venv.pth"
printf 'import fltune.integrations.sglang.tvcompat as _t; _t.install()\n' > "$SITE/zz_fltune_tvcompat.pth"

step 2/4 "sglang==$SGLANG_VERSION ${EXTRA[*]} (no dependencies: the rest is in $BASE)"
"$BASE/bin/python" -m pip --python "$VENV/bin/python" install --no-deps \
  "sglang==$SGLANG_VERSION" "${EXTRA[@]}"

step 3/4 "the fltune entry point for SGLang (metadata of this checkout's fltune)"
# fltune comes from .venv's editable install; its entry points are read from there too
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
