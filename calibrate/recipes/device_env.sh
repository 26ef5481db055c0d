# Sourced by the device recipes (calibrate/recipes/h200_*.sh) and the GPU benchmark scripts
# (benchmarks/h200_*.sh), from the repository root: the GPU machine's preamble in one place.
# Installs the wheels carried in .whl (flag_gems, sqlite-utils, and the fltune wheel built with
# `pip wheel --no-deps -w .whl .`, whose entry points vLLM needs) into /tmp/site, puts them
# before the source tree and any staged vLLM (PYTHONPATH=/tmp/vsite, ../shared/device/stage-vllm.sh).
# The built-in model profiles come with the fltune wheel (package data).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || exit 1
